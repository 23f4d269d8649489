"""The chat recipe on a tiny random-weight Hugging Face llava folder with images in the records: the labels
(placeholders expanded as `qkv chat --image` expands them, never learned), a loss that falls on two images
with different answers, what trains (LoRA + projector; tower and base weights bit-identical), the exported
llava folder against transformers, and bad input."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from qkv.cli.main import main
from qkv.finetune.chat_data import IGNORE, build_examples, read_chats
from qkv.finetune.chat_images import vision_data
from qkv.interop.tokenizer import load_hf_tokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "interop"))
from _llava_folder import IMAGE_TOKEN_ID, hf_llava, save_processor, save_tokenizer  # noqa: E402

transformers = pytest.importorskip("transformers")
QUESTION = "what is in the picture?"
ANSWERS = {"red.png": "a cat", "blue.png": "w30 w31 w32"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The tiny llava folder with a head 10x the init's scale: a frozen random head of std 0.02 caps how far
    any adapter can lift one logit above the rest (a pretrained head has no such cap)."""
    path = tmp_path_factory.mktemp("llava") / "model"
    model = hf_llava()
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    model.save_pretrained(path)
    save_tokenizer(path)
    save_processor(path)
    return path


def _image(path: Path, rgb: tuple[int, int, int]) -> Path:
    from PIL import Image

    arr = np.zeros((32, 32, 3), dtype=np.uint8) + np.array(rgb, dtype=np.uint8)
    arr[::4, ::4] = 255 - arr[::4, ::4]  # a pattern, so the patches differ
    Image.fromarray(arr).save(path)
    return path


def _record(image: str, answer: str) -> dict:
    return {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                     {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": answer}]}


@pytest.fixture()
def data(tmp_path) -> Path:
    (tmp_path / "img").mkdir()
    _image(tmp_path / "img" / "red.png", (200, 30, 30))
    _image(tmp_path / "img" / "blue.png", (20, 40, 220))
    rows = [_record(f"img/{name}", answer) for name, answer in ANSWERS.items()] * 2
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _finetune(model: Path, data: Path, out: Path, *extra: str) -> int:
    return main(["finetune", str(model), "--data", str(data), "--out", str(out), "--no-progress", *extra,
                 "train.plot=false", "train.tensorboard=false"])


def test_labels_skip_the_placeholders_and_pixels_match_the_processor(folder, data):
    from qkv import from_pretrained
    from qkv.interop.llava import ImageProcessor, load_image

    model = from_pretrained(folder)
    tok = load_hf_tokenizer(folder)
    examples, _ = build_examples(tok, read_chats(data), 256, str(data), "error", vision_data(model, folder))
    ex = examples[0]
    n = model.config.image_tokens
    assert ex.input_ids.count(IMAGE_TOKEN_ID) == n == 16
    assert all(lab == IGNORE for i, lab in zip(ex.input_ids, ex.labels) if i == IMAGE_TOKEN_ID)
    learned = [i for i, lab in zip(ex.input_ids, ex.labels) if lab != IGNORE]
    assert tok.decode(learned).split() == ANSWERS["red.png"].split()
    want = ImageProcessor.from_folder(folder)(load_image(data.parent / "img" / "red.png"))
    assert torch.equal(ex.pixel_values, want)


def test_data_url_is_the_same_image(folder, data, tmp_path):
    from qkv import from_pretrained

    url = "data:image/png;base64," + base64.b64encode((data.parent / "img" / "red.png").read_bytes()).decode()
    path = tmp_path / "url.jsonl"
    path.write_text(json.dumps(_record(url, "a cat")) + "\n", encoding="utf-8")
    model, tok = from_pretrained(folder), load_hf_tokenizer(folder)
    v = vision_data(model, folder)
    by_url, _ = build_examples(tok, read_chats(path), 256, str(path), "error", v)
    by_file, _ = build_examples(tok, read_chats(data), 256, str(data), "error", v)
    assert by_url[0].input_ids == by_file[0].input_ids and torch.equal(by_url[0].pixel_values,
                                                                         by_file[0].pixel_values)


def _state(folder: Path) -> dict[str, torch.Tensor]:
    from qkv import from_pretrained

    return from_pretrained(folder).state_dict()


def test_lora_trains_the_adapters_and_projector_only_and_exports_llava(folder, data, tmp_path, capsys):
    from qkv import from_pretrained
    from qkv.train import latest_checkpoint
    from qkv.train.checkpoint import read_checkpoint

    out = tmp_path / "out"
    assert _finetune(folder, data, out, "--lora", "--lora-targets", "all-linear", "--dev", str(data),
                     "train.max_steps=40", "train.lr=3e-2",
                     "train.batch_size=4", "train.warmup=0") == 0
    settings = json.loads((out / "finetune.json").read_text())
    assert settings["dev_loss_after"] < 0.2 * settings["dev_loss_before"]
    # what trained: the checkpoint against the source, tensor by tensor
    trained, source = read_checkpoint(latest_checkpoint(out / "checkpoints"))[0], _state(folder)
    for k, t in trained.items():
        if ".lora_" in k or k.startswith("projector."):
            continue
        assert torch.equal(t, source[k]), k  # the tower and the base language model, bit-identical
    assert any(".lora_" in k for k in trained)
    assert not torch.equal(trained["projector.linear_1.weight"], source["projector.linear_1.weight"])
    assert not any(".lora_" in k and k.startswith("vision.") for k in trained)

    # OUT loads in transformers with qkv's logits; the two images get their own answers
    hf, info = transformers.LlavaForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ours = from_pretrained(out)
    tok = load_hf_tokenizer(out)
    examples, _ = build_examples(tok, read_chats(data), 256, str(data), "error", vision_data(ours, out))
    for ex in examples[:2]:
        ids = torch.tensor([ex.input_ids])
        with torch.no_grad():
            want = hf.eval()(input_ids=ids, pixel_values=ex.pixel_values).logits
            got = ours(ids, ex.pixel_values).logits
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        targets = [i for i, lab in enumerate(ex.labels) if lab != IGNORE]
        predicted = got[0, [t - 1 for t in targets]].argmax(-1).tolist()
        assert predicted == [ex.input_ids[t] for t in targets]
    assert (out / "preprocessor_config.json").is_file()


def test_full_finetuning_freezes_the_tower(folder, data, tmp_path):
    out = tmp_path / "out"
    assert _finetune(folder, data, out, "train.max_steps=3", "train.lr=1e-3", "train.batch_size=2") == 0
    from qkv.train import latest_checkpoint
    from qkv.train.checkpoint import read_checkpoint

    trained, source = read_checkpoint(latest_checkpoint(out / "checkpoints"))[0], _state(folder)
    assert all(torch.equal(t, source[k]) for k, t in trained.items() if k.startswith("vision."))
    key = "language_model.decoder.blocks.0.attn.qkv_proj.weight"  # the language model trains in full
    assert not torch.equal(trained[key], source[key])


@pytest.mark.parametrize("content, message", [
    ([{"type": "image_url", "image_url": {"url": "nope.png"}}], "image 'nope.png': no such file"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}], "not valid base64"),
    ([{"type": "image_url", "image_url": {"url": "train.jsonl"}}], "not a readable image"),
    ([{"type": "image_url", "image_url": "x.png"}], "an image_url part needs"),
    ([{"type": "picture"}], "part 0 must be"),
])
def test_bad_images_are_one_clear_error(folder, data, tmp_path, capsys, content, message):
    bad = tmp_path / "bad.jsonl"
    rows = [_record("img/red.png", "a cat"),
            {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "a"}]}]
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert _finetune(folder, bad, tmp_path / "out", "train.max_steps=1") == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: ") and f"{bad}:2: " in err and message in err, err
    assert not (tmp_path / "out").exists()


def test_images_on_a_text_model_are_refused(llama_chat, data, tmp_path, capsys):
    assert _finetune(llama_chat, data, tmp_path / "out", "train.max_steps=1") == 2
    err = capsys.readouterr().err
    assert f"{data}:1: the record has images, but the model is not a vision-language model" in err
    assert not (tmp_path / "out").exists()


def _variant(folder: Path, tmp_path: Path, template: str | None) -> Path:
    """The folder with another chat template (None: none at all)."""
    import shutil

    out = tmp_path / "variant"
    shutil.copytree(folder, out)
    if template is None:
        (out / "chat_template.jinja").unlink()
    else:
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return out


def test_a_template_without_generation_blocks_gives_the_same_labels(folder, data, tmp_path):
    """llava-hf's own templates have no {% generation %} blocks: the answer is located in the render."""
    from qkv import from_pretrained

    plain = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    plain = plain.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    other = _variant(folder, tmp_path, plain)
    model = from_pretrained(folder)
    want, _ = build_examples(load_hf_tokenizer(folder), read_chats(data), 256, str(data), "error",
                             vision_data(model, folder))
    got, _ = build_examples(load_hf_tokenizer(other), read_chats(data), 256, str(data), "error",
                            vision_data(model, other))
    assert [(e.input_ids, e.labels) for e in got] == [(e.input_ids, e.labels) for e in want]


def test_without_a_template_the_image_token_opens_the_message(folder, data, tmp_path):
    from qkv import from_pretrained

    other = _variant(folder, tmp_path, None)
    tok = load_hf_tokenizer(other)
    examples, _ = build_examples(tok, read_chats(data), 256, str(data), "error",
                                 vision_data(from_pretrained(other), other))
    ex = examples[0]
    first = ex.input_ids.index(IMAGE_TOKEN_ID)
    assert ex.input_ids[first:first + 16] == [IMAGE_TOKEN_ID] * 16
    assert IMAGE_TOKEN_ID not in ex.input_ids[first + 16:]
    learned = [i for i, lab in zip(ex.input_ids, ex.labels) if lab != IGNORE]
    assert tok.decode(learned).split() == [*ANSWERS["red.png"].split(), "</s>"]
