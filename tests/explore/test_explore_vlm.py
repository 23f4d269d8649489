"""qkv explore on a tiny random-weight Hugging Face llava folder: a question about a built-in image, the rows
of the queries that chose the answer's tokens, and the mean attention on each image patch, all against
transformers' eager attention (output_attentions=True) on the same folder, prompt and image; the text views
(the language model's) still work."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "interop"))
sys.path.insert(0, str(Path(__file__).parents[1] / "experiments"))
from _llava_folder import IMAGE_TOKEN_ID, llava_folder  # noqa: E402
from _vlm_reference import reference  # noqa: E402

transformers = pytest.importorskip("transformers")
QUESTION, IMAGE, SIDE = "what is in the picture?", 3, 4


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Path:
    return llava_folder(tmp_path_factory.mktemp("explore_llava") / "model")


def test_info_says_a_question_about_an_image(llava, clients):
    info = clients(llava).get("/api/info").json()
    assert info["input"] == "text+image" and info["images"] == 20
    assert info["layers"] == {"decoder": 2} and info["n_heads"] == 4 and info["d_model"] == 64


def test_image_view_equals_transformers(llava, clients):
    from qkv.explore.adapter import question_image

    r = clients(llava).post("/api/analyze", json={"input": QUESTION, "image": IMAGE, "max_target_tokens": 8})
    assert r.status_code == 200, r.text
    a = r.json()
    picture, _ = question_image(None, IMAGE)
    ref = reference(llava, picture, QUESTION, IMAGE_TOKEN_ID, SIDE * SIDE, 8)
    assert a["ids"]["input"] == ref.ids + ref.answer and a["ids"]["answer"] == ref.answer
    im = a["image"]
    assert im["grid"] == [SIDE, SIDE] and im["offset"] == ref.image_positions[0]
    torch.testing.assert_close(torch.tensor(im["attention"], dtype=torch.float64), ref.grid(SIDE),
                               atol=1e-4, rtol=0)
    # the view: per layer and head, the rows that chose each answer token, over every position
    view = a["views"][0]
    assert (view["queries"], view["keys"]) == ("answer", "input")
    got = torch.tensor(view["layers"], dtype=torch.float64)  # (L, H, answer, T)
    want = torch.stack([w[0][:, ref.rows()] for w in ref.attentions]).double()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    labels = a["tokens"]["input"]
    assert labels[ref.image_positions[0]] == "img 0,0" and labels[ref.image_positions[-1]] == "img 3,3"
    assert len(im["pixels"]) == 32 and len(im["pixels"][0][0]) == 3 and im["patch_size"] == 8


def test_empty_question_and_bad_image_are_user_errors(llava, clients):
    c = clients(llava)
    r = c.post("/api/analyze", json={"input": " ", "image": 0})
    assert r.status_code == 400 and "the question is empty" in r.json()["error"]
    r = c.post("/api/analyze", json={"input": QUESTION, "image": 20})
    assert r.status_code == 400 and "out of range" in r.json()["error"]


def test_generation_and_positions_use_the_language_model(llava, clients):
    c = clients(llava)
    g = c.post("/api/generate", json={"input": "what is it", "max_new_tokens": 3})
    assert g.status_code == 200, g.text
    assert len(g.json()["steps"]) == 3
    p = c.get("/api/positions").json()
    assert [e["kind"] for e in p["encodings"]] == ["rope"]
