"""Detection canvases: Fashion-MNIST items pasted onto a black square, every item's box known.

One canvas is a pure function of (the item images, a random.Random): it draws how many items (uniform in
min_items..max_items), and for each an image, a side (uniform in min_size..max_size pixels: the 28x28 item
resized, bilinear with antialiasing) and a place. The box of an item is the tight box of its visible pixels
(>= VISIBLE of 255) after resizing, not the 28x28 frame: a trouser is narrow, a bag wide. A place whose box
overlaps an earlier one by IoU > max_iou is drawn again (up to PLACE_TRIES times; an item that finds none is
left out, so a canvas may hold fewer items than drawn, never none: the first always fits). Items are pasted
with a pixel-wise maximum, so an overlap shows both.

Boxes are (x0, y0, x1, y1) in pixels, x1 / y1 exclusive (a box of width x1 - x0); the task turns them into the
normalised (cx, cy, w, h) DETR predicts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

VISIBLE = 16  # pixel value from which an item's pixel counts as part of its box (background noise is below)
PLACE_TRIES = 20


@dataclass
class CanvasSpec:
    size: int = 64  # canvas side in pixels
    min_items: int = 1
    max_items: int = 4
    min_size: int = 16  # an item's side after resizing, in pixels
    max_size: int = 32
    max_iou: float = 0.1  # largest overlap (IoU) between two items' boxes


@dataclass
class Canvas:
    image: np.ndarray  # (size, size) uint8
    boxes: np.ndarray  # (M, 4) float32 pixels (x0, y0, x1, y1), x1 / y1 exclusive
    labels: np.ndarray  # (M,) int64 class ids


def resize_item(item: np.ndarray, side: int) -> np.ndarray:
    """A (28, 28) uint8 item -> (side, side) uint8, bilinear, antialiased (shrinking keeps thin lines)."""
    x = torch.from_numpy(np.ascontiguousarray(item, dtype=np.float32))[None, None]
    y = F.interpolate(x, size=(side, side), mode="bilinear", align_corners=False, antialias=True)
    return y[0, 0].round().clamp(0, 255).to(torch.uint8).numpy()


def tight_box(item: np.ndarray) -> tuple[int, int, int, int] | None:
    """(x0, y0, x1, y1) of the pixels >= VISIBLE of an item, x1 / y1 exclusive; None if none is visible."""
    rows, cols = np.flatnonzero((item >= VISIBLE).any(1)), np.flatnonzero((item >= VISIBLE).any(0))
    if not len(rows):
        return None
    return int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1


def iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def compose(items: np.ndarray, labels: np.ndarray, rng: random.Random, spec: CanvasSpec) -> Canvas:
    """One canvas from `items` (N, 28, 28) uint8 and their `labels` (N,) (see the module docstring)."""
    canvas = np.zeros((spec.size, spec.size), np.uint8)
    boxes: list[tuple[int, int, int, int]] = []
    classes: list[int] = []
    for _ in range(rng.randint(spec.min_items, spec.max_items)):
        k = rng.randrange(len(items))
        side = rng.randint(spec.min_size, spec.max_size)
        patch = resize_item(items[k], side)
        tight = tight_box(patch)
        if tight is None:  # an all-dark item has nothing to detect
            continue
        for _ in range(PLACE_TRIES):
            top, left = rng.randint(0, spec.size - side), rng.randint(0, spec.size - side)
            box = (left + tight[0], top + tight[1], left + tight[2], top + tight[3])
            if all(iou(box, b) <= spec.max_iou for b in boxes):
                region = canvas[top:top + side, left:left + side]
                np.maximum(region, patch, out=region)
                boxes.append(box)
                classes.append(int(labels[k]))
                break
    return Canvas(canvas, np.asarray(boxes, np.float32).reshape(-1, 4), np.asarray(classes, np.int64))
