"""`qkv attention LLAVA --image FILE --input QUESTION` on a tiny random-weight Hugging Face llava folder: the
patch map of the answer's attention against one computed from transformers (its own tokenizer, image
processor, greedy answer and eager attention with output_attentions=True), for every layer, one layer and one
token; the overlay PNG; bad input one clear error with nothing written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from qkv.cli.main import main

sys.path.insert(0, str(Path(__file__).parents[1] / "interop"))
sys.path.insert(0, str(Path(__file__).parent))
from _llava_folder import IMAGE_TOKEN_ID, llava_folder, png  # noqa: E402
from _vlm_reference import reference  # noqa: E402

transformers = pytest.importorskip("transformers")
QUESTION = "what is in the picture?"
N_PATCHES, SIDE, MAX_NEW = 16, 4, 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return llava_folder(tmp_path_factory.mktemp("llava") / "model")


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    return png(tmp_path_factory.mktemp("img") / "x.png")


def expected(folder: Path, image: Path, layers: list[int] | None, token: int | None) -> torch.Tensor:
    from PIL import Image

    ref = reference(folder, Image.open(image), QUESTION, IMAGE_TOKEN_ID, N_PATCHES, MAX_NEW)
    return ref.grid(SIDE, layers, token)


@pytest.mark.parametrize("flags, layers, token", [([], None, None), (["--layer", "-1"], [1], None),
                                                  (["--layer", "0", "--token", "1"], [0], 1)])
def test_map_equals_transformers_eager_attention(folder, image, tmp_path, capsys, flags, layers, token):
    out = tmp_path / "look.png"
    assert main(["attention", str(folder), "--image", str(image), "--input", QUESTION, "--out", str(out),
                 *flags]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "answer: " in printed
    assert "share of the attention on the image" in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    got = json.loads((tmp_path / "look_image.json").read_text())
    want = expected(folder, image, layers, token)
    torch.testing.assert_close(torch.tensor(got["grid"], dtype=torch.float64), want, atol=1e-4, rtol=0)
    assert got["image_share"] == pytest.approx(float(want.sum()), abs=1e-4)
    assert 0 < got["image_share"] < 1


def test_overlay_draws_the_map_over_the_image(folder, image, tmp_path):
    """The PNG's pixels change where the map is high: two different maps give two different pictures."""
    import matplotlib.image

    a, b = tmp_path / "a.png", tmp_path / "b.png"
    for out, layer in ((a, "0"), (b, "1")):
        assert main(["attention", str(folder), "--image", str(image), "--input", QUESTION, "--out", str(out),
                     "--layer", layer]) == 0
    assert matplotlib.image.imread(a).shape == matplotlib.image.imread(b).shape
    assert not (matplotlib.image.imread(a) == matplotlib.image.imread(b)).all()


@pytest.mark.parametrize("flags, message", [
    (["--image", "missing.png"], "--image missing.png: no such image file"),
    (["--image", "{image}", "--layer", "2"], "--layer 2: the language model has 2 layers"),
    (["--image", "{image}", "--token", "99"], "--token 99: the answer has"),
    (["--layer", "0"], "--layer and --token go with --image"),
])
def test_bad_input_is_one_clear_error(folder, image, tmp_path, capsys, flags, message):
    flags = [f.format(image=image) for f in flags]
    out = tmp_path / "o.png"
    assert main(["attention", str(folder), "--input", QUESTION, "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: ") and message in err, err
    assert not out.exists() and not (tmp_path / "o_image.json").exists()


def test_image_on_a_text_model_is_refused(tmp_path, capsys, image):
    import qkv

    folder = qkv.build("gpt2", n_layers=1, d_model=32, n_heads=2, vocab_size=50, context_length=16) \
        .save_pretrained(tmp_path / "gpt")
    assert main(["attention", str(folder), "--image", str(image), "--input", "1 2 3",
                 "--out", str(tmp_path / "o.png")]) == 2
    assert "--image needs a vision-language model folder" in capsys.readouterr().err
