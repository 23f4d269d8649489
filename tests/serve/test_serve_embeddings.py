"""/v1/embeddings of `qkv serve ENCODER_FOLDER`, through the official `openai` client: the vectors equal
transformers' masked mean (the folder's pooling) L2-normalised, for a string or a list, as floats or base64
(the client's default); usage counts the tokens; bad input is a 400 naming the field, the server unharmed."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from _servehelpers import running_app

sys.path.insert(0, str(Path(__file__).parents[1] / "finetune"))  # the tiny-folder builders of the recipes
from _encoders import make_folder  # noqa: E402

from qkv.serve.embeddings import create_embeddings_app, is_encoder_folder, load_embedder  # noqa: E402

TEXTS = ["a short one", "the second text is a little longer than the first", "third"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("bert") / "bert", "bert")


def reference(folder, texts):
    import transformers
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    hf = transformers.AutoModel.from_pretrained(folder).eval()
    rows, count = [], 0
    for t in texts:
        ids = torch.tensor([tok.encode(t).ids])
        count += ids.shape[1]
        with torch.no_grad():
            h = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
        rows.append(torch.nn.functional.normalize(h.mean(0), dim=-1).numpy())
    return np.stack(rows), count


def test_embeddings_equal_transformers_float_and_base64(bert):
    assert is_encoder_folder(bert)
    embedder = load_embedder(bert, name="bert")
    ref, tokens = reference(bert, TEXTS)
    with running_app(create_embeddings_app(embedder)) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = client.embeddings.create(model="bert", input=TEXTS)  # the client asks for base64 and decodes it
        got = np.array([d.embedding for d in r.data])
        assert [d.index for d in r.data] == [0, 1, 2]
        np.testing.assert_allclose(got, ref, atol=1e-5)
        assert r.usage.prompt_tokens == r.usage.total_tokens == tokens
        one = client.embeddings.create(model="bert", input=TEXTS[1], encoding_format="float")
        np.testing.assert_allclose(one.data[0].embedding, ref[1], atol=1e-5)
        raw = httpx.post(url + "/v1/embeddings", json={"model": "bert", "input": TEXTS[:1],
                                                       "encoding_format": "base64"}).json()
        vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
        np.testing.assert_allclose(vec, ref[0], atol=1e-5)
        assert client.models.list().data[0].id == "bert"


@pytest.mark.parametrize("body,status,param", [
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": [1, 2, 3]}, 400, "input"),
    ({"input": ["ok", ""]}, 400, "input"),
    ({"input": "word " * 100}, 400, "input"),  # past the model's 64 positions
    ({"input": "x", "encoding_format": "fp16"}, 400, "encoding_format"),
    ({"input": "x", "dimensions": 8}, 400, "dimensions"),
    ({"input": "x", "model": "other"}, 404, "model"),
])
def test_bad_input_is_400_naming_the_field(bert, body, status, param):
    embedder = load_embedder(bert, name="bert")
    with running_app(create_embeddings_app(embedder)) as (url, _):
        r = httpx.post(url + "/v1/embeddings", json={"model": "bert", **body}, timeout=60)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
        ok = httpx.post(url + "/v1/embeddings", json={"model": "bert", "input": "fine"}, timeout=60)
        assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == embedder.width
