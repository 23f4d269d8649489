"""The chat recipe on a tiny random-weight SmolVLM folder (Idefics3's tiles and image text), records with a
top-level images list: the examples against transformers' Idefics3Processor (ids and pixel values), labels
never on the image text, a LoRA run whose dev loss falls, and OUT as a smolvlm folder that transformers loads
with qkv's logits, its tower bit-identical to the source's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qkv.cli.main import main
from qkv.finetune.chat_data import IGNORE, build_examples, read_chats
from qkv.finetune.chat_images import vision_data
from qkv.interop.tokenizer import load_hf_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "interop"))
from _smolvlm_folder import IMAGE_TOKEN_ID, hf_idefics3, hf_processor, save_tokenizer  # noqa: E402
from test_chat_images_records import write_images, write_jsonl  # noqa: E402

transformers = pytest.importorskip("transformers")
ANSWERS = {"red.png": "a cat", "blue.png": "w30 w31 w32"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The tiny smolvlm folder with a head 10x the init's scale (a frozen random head of std 0.02 caps how
    far any adapter can lift one logit above the rest)."""
    path = tmp_path_factory.mktemp("smolvlm") / "model"
    model = hf_idefics3("smolvlm")
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    model.save_pretrained(path)
    save_tokenizer(path)
    hf_processor(path).save_pretrained(path)
    return path


@pytest.fixture()
def data(tmp_path) -> Path:
    write_images(tmp_path)
    rows = [{"messages": [{"role": "user", "content": "<image>what is in the picture?"},
                          {"role": "assistant", "content": answer}], "images": [f"img/{name}"]}
            for name, answer in ANSWERS.items()] * 2
    return write_jsonl(tmp_path / "train.jsonl", rows)


def _examples(folder: Path, data: Path) -> list:
    from qkv import from_pretrained

    tok = load_hf_tokenizer(folder)
    return build_examples(tok, read_chats(data), 512, str(data), "error",
                          vision_data(from_pretrained(folder), folder))[0]


def test_examples_equal_idefics3_processor(folder, data):
    from PIL import Image

    ex = _examples(folder, data)[1]  # blue.png: 40 x 70 px -> 2 x 2 tiles and the global image
    processor = transformers.AutoProcessor.from_pretrained(folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in the "
                                                                                     "picture?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": ANSWERS["blue.png"]}]}]
    text = processor.apply_chat_template(messages)
    want = processor(text=text, images=[[Image.open(data.parent / "img" / "blue.png")]], return_tensors="pt")
    assert ex.input_ids == want["input_ids"][0].tolist()
    assert ex.input_ids.count(IMAGE_TOKEN_ID) == 5 * 4
    assert torch.allclose(ex.pixel_values, want["pixel_values"][0], atol=1e-6)
    tok = load_hf_tokenizer(folder)
    learned = [i for i, lab in zip(ex.input_ids, ex.labels) if lab != IGNORE]
    assert tok.decode(learned).split()[:3] == ANSWERS["blue.png"].split()
    first, last = ex.input_ids.index(IMAGE_TOKEN_ID), len(ex.input_ids) - ex.input_ids[::-1].index(
        IMAGE_TOKEN_ID)
    assert all(lab == IGNORE for lab in ex.labels[first - 2:last + 1])  # the tiles' text is never learned


def test_lora_finetune_exports_a_smolvlm_folder(folder, data, tmp_path):
    from qkv import from_pretrained

    out = tmp_path / "out"
    assert main(["finetune", str(folder), "--data", str(data), "--dev", str(data), "--out", str(out),
                 "--no-progress", "--lora", "--lora-targets", "all-linear", "train.max_steps=30",
                 "train.lr=3e-2", "train.batch_size=4", "train.warmup=0", "train.plot=false",
                 "train.tensorboard=false"]) == 0
    settings = json.loads((out / "finetune.json").read_text())
    # the adapters learned (a margin no CPU's rounding moves); what the trained model predicts token by
    # token is not asserted: after a few steps on a tiny random model that flips with the last bit
    assert settings["dev_loss_after"] < 0.5 * settings["dev_loss_before"], settings
    assert json.loads((out / "config.json").read_text())["model_type"] == "smolvlm"

    hf, info = transformers.AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
    assert type(hf).__name__ == "SmolVLMForConditionalGeneration"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ours = from_pretrained(out)
    for ex in _examples(out, data)[:2]:
        ids = torch.tensor([ex.input_ids])
        with torch.no_grad():
            want = hf.eval()(input_ids=ids, pixel_values=ex.pixel_values[None]).logits
            got = ours(ids, ex.pixel_values).logits
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()  # OUT gives transformers qkv's logits
    # the tower is frozen: written bit for bit; the connector trained
    before, after = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(after[k], t) for k, t in before.items() if k.startswith("model.vision_model."))
    key = "model.connector.modality_projection.proj.weight"
    assert not torch.equal(after[key], before[key])
    assert (out / "processor_config.json").read_bytes() == (folder / "processor_config.json").read_bytes()


def test_full_finetuning_of_a_bf16_folder_exports_bf16_with_the_tower_unchanged(tmp_path, data):
    """Full fine-tuning trains in fp32 and writes OUT in the source's dtype; the tower stays frozen."""
    source = tmp_path / "bf16"
    hf_idefics3("idefics3").to(torch.bfloat16).save_pretrained(source)
    save_tokenizer(source)
    hf_processor(source).save_pretrained(source)
    out = tmp_path / "out"
    assert main(["finetune", str(source), "--data", str(data), "--out", str(out), "--no-progress",
                 "train.max_steps=3", "train.lr=1e-3", "train.batch_size=2", "train.plot=false",
                 "train.tensorboard=false"]) == 0
    before, after = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(after) == set(before) and {t.dtype for t in after.values()} == {torch.bfloat16}
    assert all(torch.equal(after[k], t) for k, t in before.items() if k.startswith("model.vision_model."))
    key = "model.text_model.layers.0.self_attn.q_proj.weight"  # the language model trains in full
    assert not torch.equal(after[key], before[key])
    assert json.loads((out / "config.json").read_text())["model_type"] == "idefics3"


def test_fine_tuning_expands_an_image_as_serving_does(folder, tmp_path):
    # VisionData.expansion (fine-tuning) and Idefics3Processor.expand_ids (qkv chat --image, qkv serve) give
    # the same ids for an image, whatever its tile grid
    from PIL import Image

    from qkv import from_pretrained

    tok = load_hf_tokenizer(folder)
    vd = vision_data(from_pretrained(folder), folder)
    grids = set()
    for size in ((32, 32), (80, 20), (20, 80)):
        image = Image.new("RGB", size, (200, 30, 30))
        grid = vd.processor.grid(image)
        grids.add(grid)
        served = vd.processor.expand_ids([IMAGE_TOKEN_ID], IMAGE_TOKEN_ID, [grid], tok)
        assert vd.expansion(tok, image) == served
    assert len(grids) > 1  # more than one grid: the text differs between them
