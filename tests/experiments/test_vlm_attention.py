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
from _llava_folder import IMAGE_TOKEN_ID, llava_folder, png  # noqa: E402

transformers = pytest.importorskip("transformers")
QUESTION = "what is in the picture?"
N_PATCHES, SIDE, MAX_NEW = 16, 4, 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return llava_folder(tmp_path_factory.mktemp("llava") / "model")


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    return png(tmp_path_factory.mktemp("img") / "x.png")


def reference(folder: Path, image: Path, layers: list[int] | None, token: int | None) -> torch.Tensor:
    """The (SIDE, SIDE) map from transformers alone: the prompt from the tokenizer's chat template (the
    <image> token expanded to one per patch, as LlavaProcessor does), CLIPImageProcessor's pixels, the greedy
    answer, then the eager attention of the rows that chose the answer tokens over the placeholders."""
    from PIL import Image

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    pixels = transformers.CLIPImageProcessor.from_pretrained(folder)(
        images=Image.open(image).convert("RGB"), return_tensors="pt").pixel_values
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    ids = [x for i in ids for x in ([i] * N_PATCHES if i == IMAGE_TOKEN_ID else [i])]
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(folder, attn_implementation="eager")
    hf.eval()
    prompt = torch.tensor([ids])
    with torch.no_grad():
        seq = hf.generate(input_ids=prompt, pixel_values=pixels, max_new_tokens=MAX_NEW, do_sample=False)
        att = hf(input_ids=seq, pixel_values=pixels, output_attentions=True).attentions
    n_answer = seq.shape[1] - len(ids)
    rows = [len(ids) - 1 + j for j in (range(n_answer) if token is None else [token])]
    keys = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID]
    chosen = range(len(att)) if layers is None else layers
    total = torch.zeros(len(keys), dtype=torch.float64)
    for layer in chosen:
        a = att[layer][0].double()  # (H, T, T)
        for r in rows:
            total += a[:, r, keys].sum(0)
    return (total / (len(chosen) * att[0].shape[1] * len(rows))).reshape(SIDE, SIDE)


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
    want = reference(folder, image, layers, token)
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
