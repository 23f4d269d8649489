"""Object detection on canvases composed from Fashion-MNIST items: a DETR-style detector's task.

Each canvas (tasks/canvases.py) is a black square of `canvas_size` pixels holding 1-4 Fashion-MNIST items,
resized and placed at random, with their tight boxes and classes known. The training canvases use the
official training images and are drawn from (seed, canvas index): batch `index` of size B holds canvases
index*B .. index*B+B-1, so a resumed run sees the same stream. The held-out canvases ("val") use the official
test images and `val_seed`, fixed across training seeds, so runs of different seeds score on the same
`val_canvases` canvases.

Batch: {"pixel_values": (B, 1, S, S) floats (pixels / 255, centred and scaled by the canvases' mean and std),
"labels": [{"class_labels": (M_b,) class ids, "boxes": (M_b, 4) normalised (cx, cy, w, h)}] one per canvas}
(the targets of transformers' DETR; the trainer's device move takes the list item by item). A canvas with no
box (a folder whose images are blank: no item pixel reaches canvases.VISIBLE) is a ConfigError naming it.

Evaluation: COCO box mAP (pycocotools, tasks/coco_map.py) of every query's (box, best non-empty class,
its probability) on the first n held-out canvases: map (IoU 0.50:0.95), map_50, map_75; beside it the last
decoder layer's held-out set-loss terms (loss_bbox, loss_giou, loss_ce, cardinality_error), which move long
before a short run's mAP does.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkv.config import ConfigError, setting
from qkv.models.set_loss import SetLossWeights, center_to_corners, corners_to_center, set_loss
from qkv.tasks.base import Task, check_split, model_device, register_task, rng_for
from qkv.tasks.canvases import VISIBLE, Canvas, CanvasSpec, compose
from qkv.tasks.coco_map import coco_map
from qkv.tasks.images import FASHION_APT, FASHION_CLASSES, FASHION_DIR, load_idx_folder
from qkv.tasks.options import check_options
from qkv.tasks.tokenizers import Tokenizer, WordTokenizer

STATS_CANVASES = 64  # held-out canvases whose pixel mean and std normalise every input


@dataclass
class DetectionOptions:
    path: str = setting(FASHION_DIR, "a folder with Fashion-MNIST's four IDX files")
    seed: int = setting(0, "seeds the training canvases")
    val_seed: int = setting(0, "seeds the held-out canvases (the same set whatever the training seed)")
    val_canvases: int = setting(500, "held-out canvases", ge=1)
    canvas_size: int = setting(64, "canvas side in pixels")
    # a canvas without boxes has nothing to match or score
    min_items: int = setting(1, "fewest items per canvas (uniform in min_items..max_items)", ge=1)
    max_items: int = setting(4, "most items per canvas")
    min_size: int = setting(16, "smallest side of an item on the canvas (28x28 resized)", ge=1)
    max_size: int = setting(32, "largest side of an item on the canvas")
    max_iou: float = setting(0.1, "largest overlap (IoU) between two items' boxes", ge=0, lt=1)

    def validate(self) -> None:
        check_options(self, ("min_items", "max_items"), ("min_size", "max_size"), ("max_size", "canvas_size"))

    def spec(self) -> CanvasSpec:
        return CanvasSpec(self.canvas_size, self.min_items, self.max_items, self.min_size, self.max_size,
                          self.max_iou)


def detections(logits: Tensor, pred_boxes: Tensor, width: float, height: float,
               threshold: float = 0.0) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Per image, (boxes (K, 4) in pixels (x0, y0, x1, y1), scores (K,), labels (K,)) of the queries whose
    best non-empty class scores >= threshold. logits (B, Q, C + 1) (the last class: no object), pred_boxes
    (B, Q, 4) normalised (cx, cy, w, h); as transformers' post_process_object_detection."""
    scores, labels = logits.float().softmax(-1)[..., :-1].max(-1)
    scale = torch.tensor([width, height, width, height], dtype=torch.float32, device=pred_boxes.device)
    corners = center_to_corners(pred_boxes.float()) * scale
    out = []
    for s, lab, b in zip(scores, labels, corners):
        keep = s >= threshold
        out.append((b[keep].cpu(), s[keep].cpu(), lab[keep].cpu()))
    return out


class DetectionTask(Task):
    kinds = ("detection",)
    metrics = {"map": "max", "map_50": "max", "map_75": "max", "loss_giou": "min", "loss_bbox": "min",
               "loss_ce": "min", "cardinality_error": "min"}

    def __init__(self, options: DetectionOptions, family: str, tokenizer: Tokenizer | None = None) -> None:
        self.options, self.family, self.spec = options, family, options.spec()
        root = Path(options.path).expanduser()
        if not root.is_dir():
            hint = f"; install it with: {FASHION_APT}" if str(root) == FASHION_DIR else ""
            raise ConfigError(f"no Fashion-MNIST data at {root}{hint} (or point task.path= at a folder with "
                              "the four IDX files)")
        d = load_idx_folder(root)
        self.items = {"train": (d["train_images"], d["train_labels"].astype(np.int64)),
                      "val": (d["test_images"], d["test_labels"].astype(np.int64))}
        n_classes = int(max(d["train_labels"].max(), d["test_labels"].max())) + 1
        named = n_classes == len(FASHION_CLASSES) and "fashion" in root.name.lower()
        self.classes = list(FASHION_CLASSES) if named else [str(i) for i in range(n_classes)]
        self.tokenizer = tokenizer if tokenizer is not None else WordTokenizer(
            [c.replace(" ", "_") for c in self.classes])
        stats = np.stack([self.canvas("val", k).image for k in range(STATS_CANVASES)]) / 255.0
        self.mean, self.std = float(stats.mean()), max(float(stats.std()), 1e-3)

    def canvas(self, split: str, k: int) -> Canvas:
        """Canvas number k of a split (deterministic in the split's seed and k)."""
        check_split(split)
        seed = self.options.seed if split == "train" else self.options.val_seed
        images, labels = self.items[split]
        c = compose(images, labels, rng_for(seed, split, k, "detection"), self.spec)
        if not len(c.labels):
            raise ConfigError(f"detection canvas {k} ({split}) has no boxes: no pixel of the items drawn "
                              f"for it reaches {VISIBLE}/255 (are the images under {self.options.path} "
                              "blank?)")
        return c

    def normalize(self, images: Tensor) -> Tensor:
        """uint8 (B, 1, S, S) -> the model's input floats."""
        return (images.float() / 255 - self.mean) / self.std

    def collate(self, canvases: list[Canvas]) -> dict[str, Any]:
        pixels = torch.from_numpy(np.stack([c.image for c in canvases]))[:, None]
        labels = [{"class_labels": torch.from_numpy(c.labels),
                   "boxes": corners_to_center(torch.from_numpy(c.boxes) / self.spec.size)} for c in canvases]
        return {"pixel_values": self.normalize(pixels), "labels": labels}

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, Any]:
        check_split(split)
        first = index * batch_size
        ks = range(first, first + batch_size)
        if split == "val":  # the held-out set is finite: its batches go round it
            ks = [k % self.options.val_canvases for k in ks]
        return self.collate([self.canvas(split, k) for k in ks])

    def model_overrides(self, family: str | None = None) -> dict[str, Any]:
        self._check_family(family)
        return {"image_size": self.spec.size, "n_channels": 1, "num_labels": len(self.classes)}

    @torch.no_grad()
    def predict(self, model: torch.nn.Module, canvases: list[Canvas], batch_size: int = 100,
                threshold: float = 0.0) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Each canvas's detections (see `detections`), in pixels."""
        was = model.training
        model.eval()
        dev = model_device(model)
        S, out = self.spec.size, []
        for s in range(0, len(canvases), batch_size):
            pixels = self.collate(canvases[s:s + batch_size])["pixel_values"].to(dev)
            o = model(pixels)
            out += detections(o.logits, o.pred_boxes, S, S, threshold)
        model.train(was)
        return out

    @torch.no_grad()
    def set_losses(self, model: torch.nn.Module, canvases: list[Canvas], batch_size: int = 100
                   ) -> dict[str, float]:
        """The last decoder layer's set-loss terms on `canvases` (DETR's matching and losses,
        models/set_loss.py, with the model's weights): loss_bbox and loss_giou per target box, loss_ce and
        cardinality_error per canvas (batch means weighted by batch size). Only the last layer is scored, so
        models with and without auxiliary losses compare; loss_ce does not compare across query counts (more
        queries, more no-object terms)."""
        weights = getattr(getattr(model, "config", None), "loss", None)
        weights = weights if isinstance(weights, SetLossWeights) else None
        was = model.training
        model.eval()
        dev = model_device(model)
        sums: dict[str, float] = defaultdict(float)
        for s in range(0, len(canvases), batch_size):
            chunk = canvases[s:s + batch_size]
            batch = self.collate(chunk)
            o = model(batch["pixel_values"].to(dev))
            targets = [{k: v.to(dev) for k, v in t.items()} for t in batch["labels"]]
            _, terms = set_loss(o.logits, o.pred_boxes, targets, weights)
            m = sum(len(c.labels) for c in chunk)
            for key, weight in (("loss_bbox", m), ("loss_giou", m), ("loss_ce", len(chunk)),
                                ("cardinality_error", len(chunk))):
                sums[key] += float(terms[key]) * weight
        model.train(was)
        boxes = sum(len(c.labels) for c in canvases)
        return {k: v / (boxes if k in ("loss_bbox", "loss_giou") else len(canvases)) for k, v in sums.items()}

    def evaluate(self, model: torch.nn.Module, n: int = 500, batch_size: int = 100) -> dict[str, float]:
        """COCO box mAP on the first n held-out canvases (all val_canvases by default), and the last decoder
        layer's set-loss terms on them (`set_losses`)."""
        canvases = [self.canvas("val", k) for k in range(min(n, self.options.val_canvases))]
        found = self.predict(model, canvases, batch_size)
        scores = coco_map([(c.boxes, c.labels) for c in canvases], found)
        return {**scores, **self.set_losses(model, canvases, batch_size), "n": float(len(canvases))}

    def samples(self, model: torch.nn.Module, n: int = 5, threshold: float = 0.5) -> list[str]:
        canvases = [self.canvas("val", k) for k in range(min(n, self.options.val_canvases))]
        out = []
        for k, (c, (_, scores, labels)) in enumerate(zip(canvases, self.predict(model, canvases,
                                                                                 threshold=threshold))):
            true = ", ".join(sorted(self.classes[int(i)] for i in c.labels))
            found = ", ".join(f"{self.classes[int(i)]} {float(s):.2f}"
                              for s, i in sorted(zip(scores.tolist(), labels.tolist()), reverse=True))
            out.append(f"held-out canvas {k}: true [{true}], found [{found}]")
        return out


register_task("detection", DetectionOptions, DetectionTask, ("detection",),
              "object detection on canvases of 1-4 Fashion-MNIST items (COCO mAP)", default_family="detr",
              requires=("scipy.optimize", "pycocotools"))
