"""Chat records with a top-level "images" list and <image> markers in the text (LLaVA / ShareGPT /
LLaMA-Factory's convention): the same examples (tokens, labels, pixel values, batches) as the records written
with image_url content parts, on a llava and a smolvlm folder; one clear error per bad record, nothing
written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from qkv.cli.main import main
from qkv.finetune.chat_data import build_examples, collate, read_chats
from qkv.finetune.chat_images import vision_data
from qkv.interop.tokenizer import load_hf_tokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "interop"))
from _llava_folder import llava_folder  # noqa: E402
from _smolvlm_folder import smolvlm_folder  # noqa: E402

transformers = pytest.importorskip("transformers")
QUESTION = "what is in the picture?"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlms")
    return {"llava": llava_folder(root / "llava"),
            "smolvlm": smolvlm_folder(root / "smolvlm", kind="smolvlm")}


def write_images(folder: Path) -> None:
    from PIL import Image

    (folder / "img").mkdir(exist_ok=True)
    for name, rgb, size in (("red.png", (200, 30, 30), (32, 32)), ("blue.png", (20, 40, 220), (40, 70))):
        arr = np.zeros((*size, 3), dtype=np.uint8) + np.array(rgb, dtype=np.uint8)
        arr[::4, ::4] = 255 - arr[::4, ::4]  # a pattern, so the patches differ
        Image.fromarray(arr).save(folder / "img" / name)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


# (the record with a top-level images list, the same record with content parts)
PAIRS = [
    ({"messages": [{"role": "user", "content": f"<image>\n{QUESTION}"},
                   {"role": "assistant", "content": "a cat"}], "images": ["img/red.png"]},
     {"messages": [{"role": "user", "content": [_image("img/red.png"), _text(QUESTION)]},
                   {"role": "assistant", "content": "a cat"}]}),
    ({"messages": [{"role": "system", "content": "describe it"},
                   {"role": "user", "content": "<image><image> what is in the picture?"},
                   {"role": "assistant", "content": "a cat"},
                   {"role": "user", "content": "describe <image>"},
                   {"role": "assistant", "content": "it is a cat"}],
      "images": ["img/blue.png", "img/red.png", "img/blue.png"]},
     {"messages": [{"role": "system", "content": "describe it"},
                   {"role": "user", "content": [_image("img/blue.png"), _image("img/red.png"),
                                                _text(QUESTION)]},
                   {"role": "assistant", "content": "a cat"},
                   {"role": "user", "content": [_text("describe"), _image("img/blue.png")]},
                   {"role": "assistant", "content": "it is a cat"}]}),
    ({"prompt": "<image>\ndescribe it", "completion": "a cat", "images": ["img/blue.png"]},
     {"messages": [{"role": "user", "content": [_image("img/blue.png"), _text("describe it")]},
                   {"role": "assistant", "content": "a cat"}]}),
]


@pytest.mark.parametrize("kind", ["llava", "smolvlm"])
def test_top_level_images_build_the_same_batches_as_content_parts(folders, tmp_path, kind):
    from qkv import from_pretrained

    write_images(tmp_path)
    listed = write_jsonl(tmp_path / "listed.jsonl", [a for a, _ in PAIRS])
    parts = write_jsonl(tmp_path / "parts.jsonl", [b for _, b in PAIRS])
    folder = folders[kind]
    tok, v = load_hf_tokenizer(folder), vision_data(from_pretrained(folder), folder)
    got, _ = build_examples(tok, read_chats(listed), 1024, str(listed), "error", v)
    want, _ = build_examples(tok, read_chats(parts), 1024, str(parts), "error", v)
    for g, w in zip(got, want, strict=True):
        assert g.input_ids == w.input_ids and g.labels == w.labels
        assert torch.equal(g.pixel_values, w.pixel_values)
    for key, t in collate(want, 0).items():
        assert torch.equal(collate(got, 0)[key], t), key
    n_tiles = {"llava": [1, 3, 1], "smolvlm": [5, 15, 5]}[kind]  # smolvlm: 2 x 2 tiles + the global image
    assert [len(e.pixel_values) for e in got] == n_tiles


@pytest.mark.parametrize("row, message", [
    ({"messages": [{"role": "user", "content": "<image> <image> what"},
                   {"role": "assistant", "content": "a"}], "images": ["img/red.png"]},
     "2 <image> marker(s) in the messages for 1 image(s) in 'images' (img/red.png)"),
    ({"messages": [{"role": "user", "content": "what"}, {"role": "assistant", "content": "a"}],
      "images": ["img/red.png"]}, "0 <image> marker(s) in the messages for 1 image(s)"),
    ({"messages": [{"role": "user", "content": "<image> what"}, {"role": "assistant", "content": "a"}],
      "images": ["img/nope.png"]}, "image 'img/nope.png': no such file"),
    ({"messages": [{"role": "user", "content": "<image> what"}, {"role": "assistant", "content": "a"}],
      "images": "img/red.png"}, "'images' must be a list of image file paths"),
    ({"messages": [{"role": "user", "content": [_image("img/red.png")]},
                   {"role": "assistant", "content": "a"}], "images": ["img/red.png"]},
     "either as a top-level 'images' list with <image> markers or as image_url content parts"),
])
def test_bad_records_are_one_clear_error(folders, tmp_path, capsys, row, message):
    write_images(tmp_path)
    good = PAIRS[0][0]
    bad = write_jsonl(tmp_path / "bad.jsonl", [good, row])
    rc = main(["finetune", str(folders["llava"]), "--data", str(bad), "--out", str(tmp_path / "out"),
               "--no-progress", "train.max_steps=1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("qkv: error: ") and f"{bad}:2: " in err and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_an_empty_images_list_means_no_images(folders, tmp_path):
    # LLaMA-Factory writes "images": [] on its text-only rows: with text, and with image_url content parts,
    # the record builds what it builds without the key
    from qkv import from_pretrained

    write_images(tmp_path)
    rows = [PAIRS[0][1], {"messages": [{"role": "user", "content": QUESTION},
                                       {"role": "assistant", "content": "a cat"}]}]
    listed = write_jsonl(tmp_path / "listed.jsonl", [{**r, "images": []} for r in rows])
    plain = write_jsonl(tmp_path / "plain.jsonl", rows)
    folder = folders["llava"]
    tok, v = load_hf_tokenizer(folder), vision_data(from_pretrained(folder), folder)
    got, _ = build_examples(tok, read_chats(listed), 1024, str(listed), "error", v)
    want, _ = build_examples(tok, read_chats(plain), 1024, str(plain), "error", v)
    assert [e.input_ids for e in got] == [e.input_ids for e in want] and len(got) == 2
    assert [e.labels for e in got] == [e.labels for e in want]
    assert torch.equal(got[0].pixel_values, want[0].pixel_values) and got[1].pixel_values is None
