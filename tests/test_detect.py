"""`qkv predict DETECTOR --image FILE --out FILE.png`: the boxes a trained detection run lists equal its
task's own evaluation path on the same canvas (the image file read back, resized and normalised as in
training), the drawing puts each box's outline where the box is, and bad input is one line."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from qkv.cli.main import main
from qkv.detect import COLOURS, DRAW_SIDE, Detection, draw
from qkv.run import load_model_any, load_run_task, train_run

sys.path.insert(0, str(Path(__file__).parent / "tasks"))
from test_detection import flat_folder  # noqa: E402

pytest.importorskip("pycocotools")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("detr")
    cfg = {"model": {"preset": "detr-small", "d_model": 32, "encoder_d_ff": 32, "decoder_d_ff": 32,
                     "num_queries": 6, "encoder_layers": 1, "decoder_layers": 2},
           "task": {"name": "detection", "path": str(flat_folder(tmp / "fashion")), "canvas_size": 32,
                    "min_size": 8, "max_size": 14, "val_canvases": 8},
           "train": {"max_steps": 2, "batch_size": 4, "log_every": 1, "eval_every": 0, "save_every": 0,
                     "progress": False},
           "eval": {"n": 8}}
    train_run(cfg, tmp / "run", quiet=True)
    return tmp / "run"


def hex_rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


def test_listed_boxes_equal_the_tasks_evaluation_path(run_dir, tmp_path, capsys):
    task = load_run_task(run_dir)
    canvas = task.canvas("val", 3)
    Image.fromarray(canvas.image).save(tmp_path / "canvas.png")
    out = tmp_path / "boxes.png"
    assert main(["predict", str(run_dir), "--image", str(tmp_path / "canvas.png"), "--out", str(out),
                 "--threshold", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = sorted([float(v) for v in ln.split("box")[1].split()] for ln in lines if " box " in ln)
    boxes, scores, labels = task.predict(load_model_any(run_dir), [canvas])[0]
    assert len(listed) == 6 and np.allclose(listed, sorted(np.round(boxes.numpy(), 1).tolist()), atol=0.051)
    with Image.open(out) as im:
        assert im.size == (DRAW_SIDE, DRAW_SIDE) and im.mode == "RGB"


def test_the_outline_is_drawn_where_the_box_is():
    image = Image.new("L", (64, 32))
    drawing = draw(image, [Detection("Bag", 0.9, (8.0, 10.0, 24.0, 30.0))])
    k = DRAW_SIDE // 32  # the shorter side enlarged to DRAW_SIDE
    assert drawing.size == (64 * k, 32 * k)
    px = np.asarray(drawing)
    colour = hex_rgb(COLOURS[0])
    assert tuple(px[20 * k, 8 * k]) == colour and tuple(px[20 * k, 24 * k - 1]) == colour  # left, right edge
    assert tuple(px[30 * k - 1, 16 * k]) == colour  # bottom edge
    assert tuple(px[20 * k, 16 * k]) == (0, 0, 0)  # inside: the image itself
    label_band = px[: 10 * k, 8 * k:24 * k].reshape(-1, 3)  # "Bag 0.90" on its colour above the box
    assert (label_band == colour).all(-1).sum() > 50 and (label_band >= 200).all(-1).any()  # white text


def test_a_blank_image_lists_no_object_in_one_line(run_dir, tmp_path, capsys):
    Image.new("L", (32, 32)).save(tmp_path / "blank.png")
    assert main(["predict", str(run_dir), str(tmp_path / "blank.png"), "--threshold", "1"]) == 0
    assert capsys.readouterr().out.strip().endswith("no object scored >= 1.00")


@pytest.mark.parametrize("extra, message", [
    (["--out", "{tmp}/boxes.gif2"], "no image format for suffix '.gif2'"),
    (["--out", "{tmp}/missing/boxes.png"], "does not exist"),
    (["--threshold", "1.5"], "--threshold must be in [0, 1]"),
    (["{tmp}/canvas.png", "--out", "{tmp}/b.png"], "--out draws one image's boxes; 2 images given"),
])
def test_bad_input_is_one_line(run_dir, tmp_path, capsys, extra, message):
    Image.new("L", (32, 32)).save(tmp_path / "canvas.png")
    args = ["predict", str(run_dir), str(tmp_path / "canvas.png"), *(a.format(tmp=tmp_path) for a in extra)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qkv: error:") and message in err[0]
    assert not (tmp_path / "boxes.gif2").exists()


def test_out_with_a_classifier_is_one_line(tmp_path, capsys):
    import qkv

    model = qkv.build("vit-digits")
    model.save_pretrained(tmp_path / "vit")
    Image.new("L", (8, 8)).save(tmp_path / "x.png")
    args = ["predict", str(tmp_path / "vit"), str(tmp_path / "x.png"), "--out", str(tmp_path / "o.png")]
    assert main(args) == 2
    assert "is not a detector" in capsys.readouterr().err


def test_a_hugging_face_folder_lists_transformers_boxes(tmp_path, capsys):
    """A DetrForObjectDetection folder with its DetrImageProcessor: the boxes and scores listed equal the
    processor's own preprocessing, the transformers model and post_process_object_detection."""
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent / "interop"))
    from test_detr_parity import hf_detr

    ref = hf_detr(aux=False)
    ref.save_pretrained(tmp_path / "detr")
    processor = transformers.DetrImageProcessor(size={"shortest_edge": 24, "longest_edge": 48}, do_pad=False)
    processor.save_pretrained(tmp_path / "detr")
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8))
    image.save(tmp_path / "x.png")
    assert main(["predict", str(tmp_path / "detr"), str(tmp_path / "x.png"), "--threshold", "0"]) == 0
    lines = [ln.split() for ln in capsys.readouterr().out.splitlines() if " box " in ln]
    got = sorted((float(ln[0]), *map(float, ln[-4:])) for ln in lines)
    with torch.no_grad():
        inputs = processor(images=image, return_tensors="pt")
        assert tuple(inputs["pixel_values"].shape[-2:]) == (24, 32)
        out = ref(pixel_values=inputs["pixel_values"])
        want = processor.post_process_object_detection(out, threshold=0.0, target_sizes=[(30, 40)])[0]
    expected = np.array(sorted((float(s), *b.tolist()) for s, b in zip(want["scores"], want["boxes"])))
    got = np.array(got)
    assert got.shape == expected.shape == (5, 5) and expected[:, 0].min() < 0.9  # not all "no object"
    np.testing.assert_allclose(got[:, 0], expected[:, 0], atol=6e-5)  # printed with 4 decimals
    np.testing.assert_allclose(got[:, 1:], expected[:, 1:], atol=0.051)  # and boxes with 1
