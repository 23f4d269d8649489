"""Image classification on scikit-learn's handwritten digits (or any folder of images), for ViT and Swin.

Data: `sklearn.datasets.load_digits()` ships inside scikit-learn (no download): 1,797 grey 8x8 images of the
digits 0-9, pixel values 0..16. The split is fixed (a seeded, class-stratified permutation independent of the
task seed): `test_fraction` of each class is held out as split "val" and never appears in training batches.
Optionally `image_folder` = a folder with one sub-folder per class of PNG images (read with matplotlib, made
grey, all the same size), split the same way.

Batch (both splits): {"pixel_values": (B, 1, H, W) floats in [0, 1], "labels": (B,) class ids}. Train batches
draw images with replacement, deterministically from (seed, index), and shift each by up to `max_shift`
pixels (zero fill), and optionally rotate/zoom them (`max_rotate`, `max_scale`): the augmentation that lets a
ViT generalise from 1,437 images.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkv.config import ConfigError, setting
from qkv.extras import require
from qkv.image_io import open_image
from qkv.tasks.base import Task, check_split, model_device, register_task, rng_for
from qkv.tasks.options import check_options
from qkv.tasks.tokenizers import CharTokenizer, Tokenizer, WordTokenizer

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


@dataclass
class DigitsOptions:
    seed: int = setting(0, "seeds the training batch stream (the train/test split is fixed)")
    test_fraction: float = setting(0.2, "share of each class held out as the val (test) split", gt=0, lt=1)
    max_shift: int = setting(1, "augmentation: random translation by up to this many pixels", ge=0)
    max_rotate: float = setting(0.0, "augmentation: random rotation by up to this many degrees", ge=0)
    max_scale: float = setting(0.0, "augmentation: random zoom by a factor in [1 - s, 1 + s]", ge=0, lt=1)
    image_folder: str | None = setting(None, "a folder of class folders of PNGs", none="sklearn's digits")

    def validate(self) -> None:
        check_options(self)


def load_digit_images() -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(N, 8, 8) float32 images in [0, 1], (N,) labels, class names."""
    d = require("sklearn.datasets", "the digits images").load_digits()
    return (d.images / 16.0).astype(np.float32), d.target.astype(np.int64), [str(i) for i in range(10)]


def load_image_folder(folder: str | Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Images of a folder with one sub-folder per class (PNG), as grey (N, H, W) float32 in [0, 1]."""
    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(f"image_folder {root} does not exist")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if len(classes) < 2:
        raise ConfigError(f"image_folder {root} needs at least two class sub-folders, found {classes}")
    images, labels, shape = [], [], None
    for ci, name in enumerate(classes):
        for f in sorted((root / name).glob("*.png")):
            im = open_image(f, str(f))  # within qkv.image_io's limits; a 16-bit PNG comes back as 8 bits
            img = np.asarray(im if im.mode == "L" else im.convert("RGB"), dtype=np.float32) / 255
            if img.ndim == 3:
                img = img[..., :3].mean(-1)
            if shape is None:
                shape = img.shape
            if img.shape != shape:
                raise ConfigError(f"{f} is {img.shape[1]}x{img.shape[0]}, other images are "
                                  f"{shape[1]}x{shape[0]}; resize the folder's images to one size")
            images.append(img)
            labels.append(ci)
    if not images:
        raise ConfigError(f"no .png images under {root}/<class>/")
    return np.stack(images), np.asarray(labels, dtype=np.int64), classes


def stratified_split(labels: np.ndarray, test_fraction: float,
                     seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Indices (train, test): the first ceil(test_fraction * n_c) of a seeded permutation of each class c."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(np.ceil(test_fraction * len(idx)))
        test.extend(idx[:k])
        train.extend(idx[k:])
    return np.sort(np.asarray(train)), np.sort(np.asarray(test))


def shift_images(x: Tensor, dy: Tensor, dx: Tensor) -> Tensor:
    """Translate each image of (B, C, H, W) by integer (dy, dx) with zero fill."""
    B, C, H, W = x.shape
    m = int(max(dy.abs().max(), dx.abs().max())) if B else 0
    if m == 0:
        return x
    pad = torch.nn.functional.pad(x, (m, m, m, m))
    out = torch.empty_like(x)
    for b in range(B):
        y0, x0 = m - int(dy[b]), m - int(dx[b])
        out[b] = pad[b, :, y0:y0 + H, x0:x0 + W]
    return out


def rotate_scale(x: Tensor, degrees: Tensor, scale: Tensor) -> Tensor:
    """Rotate each image of (B, C, H, W) about its centre by `degrees` and zoom by `scale` (bilinear, zero
    fill)."""
    a = degrees * torch.pi / 180
    cos, sin = torch.cos(a) / scale, torch.sin(a) / scale
    theta = torch.stack([torch.stack([cos, -sin, torch.zeros_like(a)], -1),
                         torch.stack([sin, cos, torch.zeros_like(a)], -1)], 1)  # (B, 2, 3) output -> input
    grid = torch.nn.functional.affine_grid(theta, list(x.shape), align_corners=False)
    return torch.nn.functional.grid_sample(x, grid, mode="bilinear", padding_mode="zeros",
                                           align_corners=False)


class DigitsTask(Task):
    kinds = ("image",)
    metrics = {"accuracy": "max"}

    def __init__(self, options: DigitsOptions, family: str, tokenizer: Tokenizer | None = None) -> None:
        self.options, self.family = options, family
        if options.image_folder:
            images, labels, self.classes = load_image_folder(options.image_folder)
        else:
            images, labels, self.classes = load_digit_images()
        self.images = torch.from_numpy(images).unsqueeze(1)  # (N, 1, H, W)
        self.labels = torch.from_numpy(labels)
        self.train_idx, self.test_idx = (torch.from_numpy(i)
                                             for i in stratified_split(labels, options.test_fraction))
        # a tokenizer over the class names, so predictions decode to names and the task saves like the others
        if tokenizer is None:
            tokenizer = (CharTokenizer if all(len(c) == 1 for c in self.classes)
                             else WordTokenizer)(self.classes)
        self.tokenizer = tokenizer

    @property
    def image_size(self) -> int:
        H, W = self.images.shape[-2:]
        if H != W:
            raise ConfigError(f"ViT/Swin here take square images; this data is {W}x{H}")
        return H

    def split_indices(self, split: str) -> Tensor:
        check_split(split)
        return self.train_idx if split == "train" else self.test_idx

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, Tensor]:
        idx = self.split_indices(split)
        rng = rng_for(self.options.seed, split, index, "digits")
        pick = torch.tensor([idx[rng.randrange(len(idx))] for _ in range(batch_size)], dtype=torch.long)
        x = self.images[pick]
        o = self.options
        if split == "train" and (o.max_rotate or o.max_scale):
            deg = torch.tensor([rng.uniform(-o.max_rotate, o.max_rotate) for _ in range(batch_size)])
            scale = torch.tensor([rng.uniform(1 - o.max_scale, 1 + o.max_scale) for _ in range(batch_size)])
            x = rotate_scale(x, deg, scale)
        if split == "train" and self.options.max_shift:
            s = self.options.max_shift
            dy = torch.tensor([rng.randint(-s, s) for _ in range(batch_size)])
            dx = torch.tensor([rng.randint(-s, s) for _ in range(batch_size)])
            x = shift_images(x, dy, dx)
        return {"pixel_values": x, "labels": self.labels[pick]}

    def model_overrides(self, family: str | None = None) -> dict[str, Any]:
        self._check_family(family)
        return {"image_size": self.image_size, "n_channels": 1, "num_labels": len(self.classes)}

    @torch.no_grad()
    def predict(self, model: torch.nn.Module, idx: Tensor, batch_size: int = 256) -> Tensor:
        was = model.training
        model.eval()
        dev = model_device(model)
        out = []
        for s in range(0, len(idx), batch_size):
            out.append(model(self.images[idx[s:s + batch_size]].to(dev)).logits.argmax(-1).cpu())
        model.train(was)
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)

    def evaluate(self, model: torch.nn.Module, n: int = 10_000, batch_size: int = 256) -> dict[str, float]:
        """Accuracy on the held-out test images (the first n of them; all by default)."""
        idx = self.test_idx[:n]
        pred = self.predict(model, idx, batch_size)
        return {"accuracy": float((pred == self.labels[idx]).float().mean()), "n": float(len(idx))}

    def samples(self, model: torch.nn.Module, n: int = 5) -> list[str]:
        idx = self.test_idx[:n]
        pred = self.predict(model, idx)
        out = []
        for i, p in zip(idx.tolist(), pred.tolist()):
            t = int(self.labels[i])
            out.append(f"test image {i}: true {self.classes[t]}, predicted {self.classes[p]}"
                       + ("  (ok)" if p == t else ""))
        return out


register_task("digits", DigitsOptions, DigitsTask, ("image",),
              "scikit-learn's 8x8 handwritten digits (or an image folder): image classification",
              default_family="vit")
