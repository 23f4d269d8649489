"""`qkv embed`: mean-pooled / [CLS] sentence embeddings equal a transformers reference (AutoModel + masked
mean + L2 norm) for BERT, RoBERTa and DistilBERT folders built here; --query ranks an input line first."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent / "finetune"))  # the tiny-folder builders of the recipe tests
from _encoders import make_folder, sentiment_rows  # noqa: E402

from qkv.cli.main import main  # noqa: E402
from qkv.embed import run  # noqa: E402


def _reference(folder, texts, pooling):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    hf = transformers.AutoModel.from_pretrained(folder).eval()
    pad = hf.config.pad_token_id or 0
    rows = []
    for t in texts:  # one at a time: no padding at all in the reference
        ids = torch.tensor([tok.encode(t).ids])
        with torch.no_grad():
            h = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
        v = h.mean(0) if pooling == "mean" else h[0]
        rows.append(torch.nn.functional.normalize(v, dim=-1))
    assert pad is not None
    return torch.stack(rows).numpy()


@pytest.mark.parametrize("family, pooling", [("bert", "mean"), ("roberta", "mean"), ("distilbert", "cls")])
def test_embeddings_equal_transformers_pooling(tmp_path, family, pooling):
    folder = make_folder(tmp_path / family, family)
    texts = [r["text"] for r in sentiment_rows(13, 5)]  # lengths differ: batches are padded
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    out = tmp_path / "emb.npy"
    run(str(folder), str(tmp_path / "texts.txt"), out=str(out), pooling=pooling, batch_size=4, progress=False)
    emb = np.load(out)
    ref = _reference(folder, texts, pooling)
    assert emb.shape == ref.shape and emb.dtype == np.float32
    np.testing.assert_allclose(emb, ref, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)


def test_query_mode_and_errors(tmp_path, capsys):
    folder = make_folder(tmp_path / "bert", "bert", layers=1)
    texts = [r["text"] for r in sentiment_rows(9, 6)]
    (tmp_path / "texts.txt").write_text("\n".join(texts))
    assert main(["embed", str(folder), "--input", str(tmp_path / "texts.txt"), "--query", texts[4], "--top-k", "3",
                 "--no-progress"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and "line 5:" in lines[0] and "1.0000" in lines[0]
    (tmp_path / "bad.txt").write_text("w1\n\nw2\n")
    assert main(["embed", str(folder), "--input", str(tmp_path / "bad.txt"), "--out", str(tmp_path / "e.npy")]) == 2
    assert "line 2 is empty" in capsys.readouterr().err
    assert main(["embed", str(folder), "--input", str(tmp_path / "texts.txt")]) == 2
    assert "--out" in capsys.readouterr().err
