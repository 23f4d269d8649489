"""qkv predict (Hugging Face image folders and qkv image runs), its preprocessing against transformers' own
image processors, and the other commands on a ResNet folder: info works, attention / explore refuse."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import _clirun as clirun

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from qkv.predict import ImagePreprocessor, predict_images  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str):
    return clirun.run_cli(*args, cwd=ROOT)


def _image(path: Path, w: int = 45, h: int = 30, seed: int = 0) -> Path:
    a = np.random.default_rng(seed).integers(0, 256, (h, w, 3)).astype(np.uint8)
    Image.fromarray(a).save(path)
    return path


def _pil_processor(cls_name, **kw):
    cls = getattr(transformers, f"{cls_name}Pil", None) or getattr(transformers, cls_name)
    return cls(**kw)


@pytest.mark.parametrize("cls_name, kw", [
    ("ViTImageProcessor", dict(size={"height": 24, "width": 20})),
    ("ConvNextImageProcessor", dict(size={"shortest_edge": 32}, crop_pct=0.875)),
    ("ConvNextImageProcessor", dict(size={"shortest_edge": 400})),
])
def test_preprocessing_equals_transformers(tmp_path, cls_name, kw):
    proc = _pil_processor(cls_name, **kw)
    proc.save_pretrained(tmp_path)
    pre = ImagePreprocessor.from_hf(json.loads((tmp_path / "preprocessor_config.json").read_text()), 3)
    for w, h in [(45, 30), (30, 61)]:
        im = Image.open(_image(tmp_path / f"{w}x{h}.png", w, h))
        ref = proc(im, return_tensors="pt")["pixel_values"][0]
        torch.testing.assert_close(pre(im), ref.float(), atol=1e-5, rtol=1e-5)


@pytest.fixture
def resnet_folder(tmp_path):
    torch.manual_seed(0)
    labels = {i: name for i, name in enumerate(["cat", "dog", "fox", "owl", "elk", "yak", "emu"])}
    cfg = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                                    id2label=labels, label2id={v: k for k, v in labels.items()})
    hf = transformers.ResNetForImageClassification(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path / "resnet"
    hf.save_pretrained(folder)
    _pil_processor("ConvNextImageProcessor", size={"shortest_edge": 32}).save_pretrained(folder)
    return folder, hf


def test_predict_on_a_resnet_folder_equals_transformers(resnet_folder, tmp_path):
    folder, hf = resnet_folder
    images = [_image(tmp_path / "a.png", seed=1), _image(tmp_path / "b.jpg", 30, 50, seed=2)]
    rows = predict_images(folder, [str(p) for p in images], top_k=5)
    proc = _pil_processor("ConvNextImageProcessor", size={"shortest_edge": 32})
    for (name, top), path in zip(rows, images):
        with torch.no_grad():
            probs = hf(**proc(Image.open(path), return_tensors="pt")).logits.softmax(-1)[0]
        want = probs.topk(5)
        assert name == str(path) and [n for n, _ in top] == [hf.config.id2label[int(i)] for i in want.indices]
        np.testing.assert_allclose([p for _, p in top], want.values.tolist(), atol=1e-4)
    r = run_cli("predict", str(folder), str(images[0]), "--top-k", "3")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == str(images[0]) and len(lines) == 4 and lines[1].split()[1] == rows[0][1][0][0]


def test_predict_errors_are_one_line(resnet_folder, tmp_path):
    folder, _ = resnet_folder
    r = run_cli("predict", str(folder), str(tmp_path / "missing.png"))
    assert r.returncode == 2 and "qkv: error: image not found" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "x.png").write_bytes(b"not a png")
    r = run_cli("predict", str(folder), str(tmp_path / "x.png"))
    assert r.returncode == 2 and "not a readable image" in r.stderr
    hf = transformers.ResNetModel(transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8], depths=[1]))
    hf.save_pretrained(tmp_path / "base")
    r = run_cli("predict", str(tmp_path / "base"), str(_image(tmp_path / "ok.png")))
    assert r.returncode == 2 and "needs an image classifier" in r.stderr


def test_info_works_and_attention_explore_refuse_on_resnet(resnet_folder, tmp_path):
    folder, _ = resnet_folder
    r = run_cli("info", str(folder))
    assert r.returncode == 0 and "ResNet (Hugging Face resnet folder, float32)" in r.stdout, r.stderr
    for args in (["attention", str(folder), "--input", "1"], ["explore", str(folder), "--export", "x.html"]):
        r = run_cli(*args)
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("qkv: error:")]
        assert r.returncode == 2 and len(errors) == 1 and "no attention" in errors[0], r.stderr
    assert not (ROOT / "x.html").exists()


def test_predict_on_a_qkv_image_run(tmp_path):
    from tests.tasks.test_images import _write_images

    root = _write_images(tmp_path / "pets", {"cat": [(20, 20)] * 6, "dog": [(24, 16)] * 6})
    out = tmp_path / "run"
    r = run_cli("train", "--task", "image_folder", "--model", "resnet-8-cifar", "--out", str(out),
                "--max-steps", "2",
                f"task.path={root}", "task.image_size=12", "train.batch_size=4", "train.progress=false",
                "train.plot=false")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = predict_images(out, [str(root / "dog" / "0.png")], top_k=5)
    # both classes, named, top-k cut to 2
    assert [n for n, _ in rows[0][1]] in (["cat", "dog"], ["dog", "cat"])
    assert abs(sum(p for _, p in rows[0][1]) - 1) < 1e-5
    r = run_cli("eval", str(out), "-n", "4")
    assert r.returncode == 0 and "accuracy:" in r.stdout, r.stderr


def test_vit_attention_overlay_on_an_image_folder_run(tmp_path):
    # the image tasks keep uint8 pixels: the overlay normalises them as the task's batches do
    from tests.tasks.test_images import _write_images

    root = _write_images(tmp_path / "pets", {"cat": [(20, 20)] * 5, "dog": [(24, 16)] * 5})
    out = tmp_path / "vit"
    r = run_cli("train", "--task", "image_folder", "--model", "vit-digits", "--out", str(out), "--max-steps",
                "1",
                f"task.path={root}", "task.image_size=8", "task.channels=1", "train.batch_size=4",
                "train.progress=false", "train.plot=false")
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli("attention", str(out), "--input", "1", "--out", str(tmp_path / "att.png"))
    assert r.returncode == 0 and (tmp_path / "att.png").is_file(), r.stderr[-2000:]


def test_a_decompression_bomb_is_one_line(resnet_folder, tmp_path):
    """A 2 KB PNG declaring 60,000 x 60,000 pixels: refused from its header (qkv.image_io), not a Pillow
    DecompressionBombError traceback."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    bomb = tmp_path / "bomb.png"
    header = struct.pack(">IIBBBBB", 60_000, 60_000, 8, 2, 0, 0, 0)
    data = zlib.compress(b"\0" * 2000)
    bomb.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data)
                     + chunk(b"IEND", b""))
    r = run_cli("predict", str(resnet_folder[0]), str(bomb))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == (f"qkv: error: {bomb}: the image declares 3,600,000,000 pixels, over the "
                                "limit of 33,177,600")
