"""The detection task: canvases whose boxes are read back from the pixels, COCO mAP on cases computed by hand,
the evaluation wiring through an oracle detector (mAP 1), the drawing, and bad input."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from qkv.config import ConfigError
from qkv.tasks.canvases import VISIBLE, CanvasSpec, compose
from qkv.tasks.coco_map import coco_map
from qkv.tasks.detection import DetectionOptions, DetectionTask, detections
from qkv.tasks.images import FASHION_DIR

sys.path.insert(0, str(Path(__file__).parent))
from _fashion_idx import write_idx  # noqa: E402

pytest.importorskip("pycocotools")
HAS_FASHION = Path(FASHION_DIR).is_dir()


def flat_folder(root: Path, value_of=lambda c: 30 + 20 * c, n: int = 40) -> Path:
    """IDX files of 28x28 images filled with one grey level per class: a resized item stays that flat square,
    so its box is the whole patch and its class is its grey level."""
    root.mkdir(parents=True, exist_ok=True)
    for split in ("train", "t10k"):
        labels = (np.arange(n) % 10).astype(np.uint8)
        images = np.stack([np.full((28, 28), value_of(int(c)), np.uint8) for c in labels])
        write_idx(root / f"{split}-images-idx3-ubyte.gz", images)
        write_idx(root / f"{split}-labels-idx1-ubyte.gz", labels)
    return root


# -- COCO mAP, by hand ---------------------------------------------------------------------------------
def test_perfect_detections_score_one():
    t = [(np.array([[10, 10, 30, 30], [40, 40, 60, 50]]), np.array([1, 2])), (np.array([[0, 0, 5, 9]]), [7])]
    d = [(b, np.full(len(lab), 0.9), lab) for b, lab in t]
    assert coco_map(t, d) == pytest.approx({"map": 1.0, "map_50": 1.0, "map_75": 1.0})


def test_a_shifted_box_counts_at_the_thresholds_below_its_iou():
    # a 100x10 box and the same box shifted right by x: IoU = (100 - x) / (100 + x) = 0.62, so it matches at
    # the IoU thresholds 0.50, 0.55, 0.60 and misses at 0.65 .. 0.95: mAP = 3 / 10
    x = 100 * (1 - 0.62) / (1 + 0.62)
    scores = coco_map([(np.array([[0, 0, 100, 10]]), [0])], [(np.array([[x, 0, 100 + x, 10]]), [0.9], [0])])
    assert scores == pytest.approx({"map": 0.3, "map_50": 1.0, "map_75": 0.0})


def test_a_false_positive_ranked_first_halves_the_precision():
    # detections by score: a miss, then the hit: recall reaches 1 at precision 1/2, and COCO's interpolated
    # precision (the best at any recall >= r) is 1/2 at every recall point
    t = [(np.array([[0, 0, 10, 10]]), [0])]
    d = [(np.array([[50, 50, 60, 60], [0, 0, 10, 10]]), [0.9, 0.8], [0, 0])]
    assert coco_map(t, d)["map"] == pytest.approx(0.5)


def test_classes_are_averaged_and_a_wrong_class_is_a_miss():
    t = [(np.array([[0, 0, 10, 10], [20, 20, 30, 30]]), [0, 1])]
    d = [(np.array([[0, 0, 10, 10], [20, 20, 30, 30]]), [0.9, 0.9], [0, 3])]  # class 1's box called class 3
    assert coco_map(t, d)["map"] == pytest.approx(0.5)  # class 0: 1, class 1: 0; class 3 has no target


def test_no_detection_scores_zero_and_no_target_is_an_error():
    assert coco_map([(np.array([[0, 0, 4, 4]]), [0])], [(np.zeros((0, 4)), [], [])])["map"] == 0.0
    with pytest.raises(ValueError, match="at least one target box"):
        coco_map([(np.zeros((0, 4)), [])], [(np.array([[0, 0, 4, 4]]), [0.5], [0])])


# -- canvases ------------------------------------------------------------------------------------------
def test_flat_items_boxes_and_classes_read_back_from_the_pixels(tmp_path):
    root = flat_folder(tmp_path / "fashion")
    task = DetectionTask(DetectionOptions(path=str(root), max_iou=0.0), "detr")
    seen = set()
    for k in range(40):
        c = task.canvas("train", k)
        covered = np.zeros_like(c.image, bool)
        for (x0, y0, x1, y1), label in zip(c.boxes.astype(int), c.labels):
            patch = c.image[y0:y1, x0:x1]
            assert (patch == 30 + 20 * label).all() and 16 <= x1 - x0 <= 32 and y1 - y0 == x1 - x0
            covered[y0:y1, x0:x1] = True
            seen.add(int(label))
        assert (c.image[~covered] == 0).all() and 1 <= len(c.labels) <= 4
    assert len(seen) >= 8


@pytest.mark.skipif(not HAS_FASHION, reason="needs Debian's dataset-fashion-mnist")
def test_fashion_boxes_are_tight_and_canvases_reproducible():
    task = DetectionTask(DetectionOptions(), "detr")
    for k in range(30):
        c = task.canvas("train", k)
        visible = c.image >= VISIBLE
        inside = np.zeros_like(visible)
        for x0, y0, x1, y1 in c.boxes.astype(int):
            inside[y0:y1, x0:x1] = True
            # tight: each edge row / column of the box holds a visible pixel
            assert visible[y0, x0:x1].any() and visible[y1 - 1, x0:x1].any()
            assert visible[y0:y1, x0].any() and visible[y0:y1, x1 - 1].any()
        assert not (visible & ~inside).any()
    a, b = task.batch(3, 8), DetectionTask(DetectionOptions(), "detr").batch(3, 8)
    assert torch.equal(a["pixel_values"], b["pixel_values"])
    other = DetectionTask(DetectionOptions(seed=1), "detr")
    assert not torch.equal(other.batch(3, 8)["pixel_values"], a["pixel_values"])
    assert torch.equal(other.batch(0, 8, "val")["pixel_values"], task.batch(0, 8, "val")["pixel_values"])


def test_batch_targets_are_normalised_centre_boxes(tmp_path):
    task = DetectionTask(DetectionOptions(path=str(flat_folder(tmp_path / "f")), canvas_size=48, min_size=10,
                                          max_size=20), "detr")
    batch = task.batch(2, 4)
    assert batch["pixel_values"].shape == (4, 1, 48, 48)
    for k, t in enumerate(batch["labels"]):
        c = task.canvas("train", 2 * 4 + k)
        x0, y0, x1, y1 = (torch.from_numpy(c.boxes) / 48).unbind(-1)
        assert torch.allclose(t["boxes"], torch.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], -1))
        assert t["class_labels"].tolist() == c.labels.tolist()
    raw = batch["pixel_values"] * task.std + task.mean  # the normalisation undone gives the pixels back
    assert torch.allclose(raw[0, 0] * 255, torch.from_numpy(task.canvas("train", 8).image).float(), atol=1e-3)


def test_compose_is_a_function_of_its_random_stream():
    items, labels = np.full((5, 28, 28), 200, np.uint8), np.arange(5)
    spec = CanvasSpec(size=40, min_items=2, max_items=3, min_size=8, max_size=12)
    one, two = compose(items, labels, random.Random(7), spec), compose(items, labels, random.Random(7), spec)
    assert np.array_equal(one.image, two.image) and np.array_equal(one.boxes, two.boxes)


# -- the evaluation's wiring ---------------------------------------------------------------------------
class Oracle(nn.Module):
    """Answers the held-out canvases 0..n-1 in order (and again from 0 on each pass) with their true boxes (as
    DETR outputs them: normalised centre boxes, logits over the classes + "no object"); the other queries say
    "no object"."""

    def __init__(self, task: DetectionTask, n: int, queries: int = 6, shift: float = 0.0) -> None:
        super().__init__()
        self.task, self.n, self.queries, self.shift, self.next = task, n, queries, shift, 0
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, pixel_values):
        B, S, C = pixel_values.shape[0], self.task.spec.size, len(self.task.classes)
        logits = torch.full((B, self.queries, C + 1), -10.0)
        logits[..., C] = 10.0
        boxes = torch.full((B, self.queries, 4), 0.5)
        for b in range(B):
            c = self.task.canvas("val", self.next % self.n)
            self.next += 1
            for q, ((x0, y0, x1, y1), label) in enumerate(zip(c.boxes + [self.shift, 0, self.shift, 0],
                                                             c.labels)):
                logits[b, q, C], logits[b, q, label] = -10.0, 10.0
                boxes[b, q] = torch.tensor([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0]) / S
        return type("Out", (), {"logits": logits, "pred_boxes": boxes})()


def test_an_oracle_scores_map_one_and_a_shifted_one_less(tmp_path):
    # the evaluation path end to end: canvases -> the model's normalised centre boxes -> pixel corners -> COCO
    # mAP, and the held-out set-loss terms of the same outputs
    task = DetectionTask(DetectionOptions(path=str(flat_folder(tmp_path / "f")), val_canvases=30), "detr")
    scores = task.evaluate(Oracle(task, 30), n=30, batch_size=7)
    assert scores["map"] == pytest.approx(1.0) and scores["n"] == 30
    assert scores["loss_bbox"] == pytest.approx(0.0, abs=1e-6)
    assert scores["loss_giou"] == pytest.approx(0.0, abs=1e-6)
    assert scores["cardinality_error"] == 0.0
    assert set(scores) - {"n"} == set(DetectionTask.metrics)  # every score declared, with its direction
    shifted = task.evaluate(Oracle(task, 30, shift=4.0), n=30, batch_size=7)  # 4 px on 16..32 px items
    assert 0.0 < shifted["map"] < 0.9 and shifted["map_50"] > shifted["map_75"]
    # each matched box off by 4 px in cx only, on a 64 px canvas: L1 = 4 / 64 per box
    assert shifted["loss_bbox"] == pytest.approx(4 / 64, abs=1e-6) and shifted["loss_giou"] > 0.1


def test_detections_keep_the_queries_over_the_threshold():
    logits = torch.tensor([[[4.0, 0.0, 0.0], [0.0, 0.0, 4.0]]])  # query 0: class 0; query 1: no object
    boxes = torch.tensor([[[0.5, 0.5, 0.5, 0.25], [0.1, 0.1, 0.1, 0.1]]])
    (b, s, lab), = detections(logits, boxes, width=200, height=100, threshold=0.5)
    assert lab.tolist() == [0] and b.tolist() == [[50.0, 37.5, 150.0, 62.5]]
    assert s.item() == pytest.approx(np.exp(4) / (np.exp(4) + 2))


# -- bad input -----------------------------------------------------------------------------------------
def test_a_canvas_with_no_boxes_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="task.min_items must be at least 1, got 0"):
        DetectionOptions(min_items=0).validate()
    blank = flat_folder(tmp_path / "blank", value_of=lambda c: 5)  # below VISIBLE: nothing to box
    with pytest.raises(ConfigError, match=r"detection canvas 0 \(val\) has no boxes"):
        DetectionTask(DetectionOptions(path=str(blank)), "detr")
    with pytest.raises(ConfigError, match=r"task.canvas_size must be at least max_size \(80\), got 64"):
        DetectionOptions(max_size=80).validate()


def test_the_targets_follow_the_trainers_device_move(tmp_path):
    from qkv.train.batches import to_device

    task = DetectionTask(DetectionOptions(path=str(flat_folder(tmp_path / "f"))), "detr")
    moved = to_device(task.batch(0, 3), torch.device("meta"))
    assert moved["pixel_values"].is_meta and len(moved["labels"]) == 3
    assert all(t["boxes"].is_meta and t["class_labels"].is_meta for t in moved["labels"])
