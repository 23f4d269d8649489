"""Image classification on real images: Fashion-MNIST (or MNIST) from IDX files, and a folder of images.

fashion_mnist: the four IDX files of Zalando's Fashion-MNIST (60,000 training and 10,000 test 28x28 grey
images,
  10 classes), as Debian's `dataset-fashion-mnist` installs them under /usr/share/datasets/fashion-mnist/
  (gzipped); `path=` names any folder with the same four files (MNIST's too), gzipped or not. The split
  "val" is the official test set: a run's figures are test accuracy (selection of checkpoints/best on it is
  the only use a run makes of it; the documented figures are the last step's).
image_folder: one sub-folder per class of images (PNG, JPEG, ...; read with Pillow), made grey or RGB and
  resized to image_size x image_size; a fixed, class-stratified split by `split_seed` holds `dev_fraction` of
  each class out as "val".

Batch (both splits): {"pixel_values": (B, C, H, W) floats normalised by the training images' mean and std,
"labels": (B,) class ids}. Training batches walk seeded permutations of the training images (one per epoch,
deterministic in (seed, index), so a resumed run sees the same stream) with light augmentation: a random crop
of the image padded by `pad` pixels (zero fill) and a horizontal flip with probability 1/2 (`hflip`; off for
digits, whose mirror images are other symbols).
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from qkv.config import ConfigError, setting
from qkv.image_io import open_image
from qkv.tasks.base import Task, check_split, model_device, register_task, rng_for
from qkv.tasks.digits import stratified_split
from qkv.tasks.options import check_option, check_options
from qkv.tasks.tokenizers import WordTokenizer

FASHION_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_APT = "apt-get install dataset-fashion-mnist"
FASHION_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                   "Ankle boot")
IDX_FILES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
             "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}
# IDX type byte -> numpy dtype (big-endian, as the format stores every multi-byte number)
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (LeCun's MNIST format; gzipped when the name ends in .gz) as a numpy array: two zero bytes,
    a type byte, the number of dimensions, each dimension as a big-endian uint32, then the data."""
    path = Path(path)
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise ConfigError(f"{path}: not a readable gzip file ({e})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ConfigError(f"{path}: not an IDX file (bad magic number {raw[:4].hex() or 'empty'})")
    ndim = raw[3]
    shape = tuple(int(d)
                      for d in np.frombuffer(raw, ">u4", count=ndim, offset=4)) if len(raw) >= 4 + 4 * ndim \
        else None
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    start = 4 + 4 * ndim
    if shape is None or len(raw) - start != int(np.prod(shape)) * dtype.itemsize:
        raise ConfigError(f"{path}: truncated or padded IDX file (header says {shape}, {len(raw) - start} "
                          "data bytes)")
    return np.frombuffer(raw, dtype, offset=start).reshape(shape)


def _idx_path(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def load_idx_folder(folder: str | Path) -> dict[str, np.ndarray]:
    """The four MNIST-layout IDX files of `folder` (train/t10k images/labels), checked against each other."""
    root = Path(folder).expanduser()
    paths = {k: _idx_path(root, stem) for k, stem in IDX_FILES.items()}
    missing = [IDX_FILES[k] for k, p in paths.items() if p is None]
    if missing:
        hint = f" (install the data with: {FASHION_APT})" if str(root) == FASHION_DIR else ""
        raise ConfigError(f"{root}: missing IDX file(s) {', '.join(missing)} (gzipped or not){hint}")
    data = {k: read_idx(p) for k, p in paths.items()}
    for split in ("train", "test"):
        x, y = data[f"{split}_images"], data[f"{split}_labels"]
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ConfigError(f"{root}: {split} images {x.shape} and labels {y.shape} do not match")
    return data


def load_image_files(folder: str | Path, image_size: int,
                     channels: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """A folder of class sub-folders -> (N, H, W, C) uint8 images resized to image_size, (N,) labels,
    classes."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ConfigError(f"image folder {root} does not exist")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if len(classes) < 2:
        raise ConfigError(f"image folder {root} needs at least two class sub-folders, found {classes}")
    images, labels = [], []
    for ci, name in enumerate(classes):
        for f in sorted(p for p in (root / name).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
            im = open_image(f, str(f)).convert("L" if channels == 1 else "RGB")
            im = im.resize((image_size, image_size), Image.Resampling.BILINEAR)
            images.append(np.asarray(im, dtype=np.uint8).reshape(image_size, image_size, channels))
            labels.append(ci)
    if not images:
        raise ConfigError(f"no images ({', '.join(IMAGE_SUFFIXES)}) under {root}/<class>/")
    return np.stack(images), np.asarray(labels, dtype=np.int64), classes


def augment(x: Tensor, pad: int, hflip: bool, gen: torch.Generator) -> Tensor:
    """Random crop of the zero-padded image (a shift by up to `pad` pixels) and a random horizontal flip."""
    B, C, H, W = x.shape
    if pad:
        dy = torch.randint(0, 2 * pad + 1, (B,), generator=gen)
        dx = torch.randint(0, 2 * pad + 1, (B,), generator=gen)
        xp = F.pad(x, (pad, pad, pad, pad))
        rows = (torch.arange(H)[None] + dy[:, None])[:, None, :, None]  # (B, 1, H, 1)
        cols = (torch.arange(W)[None] + dx[:, None])[:, None, None, :]  # (B, 1, 1, W)
        x = xp[torch.arange(B)[:, None, None, None], torch.arange(C)[None, :, None, None], rows, cols]
    if hflip:
        flip = torch.rand(B, generator=gen) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    return x


class ImageClassificationTask(Task):
    """Shared by both tasks: uint8 images (N, C, H, W), labels, the split, normalisation and augmentation."""

    kinds = ("image",)
    metrics = {"accuracy": "max"}

    def __init__(self, options: Any, family: str, images: np.ndarray, labels: np.ndarray, classes: list[str],
                 train_idx: np.ndarray, val_idx: np.ndarray, tokenizer: Any = None) -> None:
        self.options, self.family, self.classes = options, family, list(classes)
        self.images = torch.from_numpy(np.ascontiguousarray(images))  # (N, C, H, W) uint8
        self.labels = torch.from_numpy(labels.astype(np.int64))
        self.train_idx, self.val_idx = torch.from_numpy(train_idx), torch.from_numpy(val_idx)
        train = self.images[self.train_idx].float() / 255
        # per-channel statistics of the training images: inputs to the first conv centred and scaled
        self.mean = train.mean(dim=(0, 2, 3)).view(1, -1, 1, 1)
        self.std = train.std(dim=(0, 2, 3)).clamp_min(1e-3).view(1, -1, 1, 1)
        # the class names as a vocabulary, so the run saves like the others and predictions decode to names
        self.tokenizer = (tokenizer if tokenizer is not None
                          else WordTokenizer([c.replace(" ", "_") for c in classes]))

    @property
    def image_size(self) -> int:
        H, W = self.images.shape[-2:]
        if H != W:
            raise ConfigError(f"the image models here take square images; this data is {W}x{H}")
        return H

    def split_indices(self, split: str) -> Tensor:
        check_split(split)
        return self.train_idx if split == "train" else self.val_idx

    def normalize(self, images: Tensor) -> Tensor:
        """uint8 (B, C, H, W) -> normalised floats."""
        return (images.float() / 255 - self.mean) / self.std

    def batch_positions(self, index: int, batch_size: int, split: str = "train") -> Tensor:
        """Which images of the split batch `index` holds: positions index*B .. index*B+B-1 of an endless
        stream of seeded per-epoch permutations of the split (each epoch sees every image once)."""
        n = len(self.split_indices(split))
        pos = torch.arange(index * batch_size, (index + 1) * batch_size)
        picks = []
        for epoch in pos.div(n, rounding_mode="floor").unique().tolist():
            g = torch.Generator().manual_seed(hash_seed(self.options.seed, split, epoch))
            picks.append(torch.randperm(n, generator=g)[pos[pos // n == epoch] % n])
        return torch.cat(picks)

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, Tensor]:
        pick = self.split_indices(split)[self.batch_positions(index, batch_size, split)]
        x = self.normalize(self.images[pick])
        if split == "train":
            gen = torch.Generator().manual_seed(hash_seed(self.options.seed, "augment", index))
            x = augment(x, self.options.pad, self.options.hflip, gen)
        return {"pixel_values": x, "labels": self.labels[pick]}

    def model_overrides(self, family: str | None = None) -> dict[str, Any]:
        self._check_family(family)
        return {"image_size": self.image_size, "n_channels": int(self.images.shape[1]),
                "num_labels": len(self.classes)}

    @torch.no_grad()
    def predict(self, model: torch.nn.Module, idx: Tensor, batch_size: int = 500) -> Tensor:
        was = model.training
        model.eval()
        dev = model_device(model)
        out = [model(self.normalize(self.images[idx[s:s + batch_size]]).to(dev)).logits.argmax(-1).cpu()
               for s in range(0, len(idx), batch_size)]
        model.train(was)
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)

    def evaluate(self, model: torch.nn.Module, n: int = 100_000, batch_size: int = 500) -> dict[str, float]:
        """Accuracy on the held-out split (its first n images; all by default)."""
        idx = self.val_idx[:n]
        pred = self.predict(model, idx, batch_size)
        return {"accuracy": float((pred == self.labels[idx]).float().mean()), "n": float(len(idx))}

    def samples(self, model: torch.nn.Module, n: int = 5) -> list[str]:
        idx = self.val_idx[:n]
        pred = self.predict(model, idx)
        return [f"held-out image {i}: true {self.classes[int(self.labels[i])]}, predicted {self.classes[p]}"
                + ("  (ok)" if p == int(self.labels[i]) else "") for i, p in zip(idx.tolist(), pred.tolist())]


def hash_seed(*parts: Any) -> int:
    """A 63-bit torch seed from (seed, split, index ...), the same on every platform (rng_for's hashing)."""
    return rng_for(parts[0], str(parts[1]), int(parts[2]), "images").getrandbits(63)


@dataclass
class FashionMNISTOptions:
    path: str = setting(FASHION_DIR, "a folder with the four IDX files (Fashion-MNIST's, or MNIST's)")
    seed: int = setting(0, "seeds the training stream (order and augmentation)")
    pad: int = setting(2, "augmentation: random crop of the image padded by this many pixels", ge=0)
    hflip: bool = setting(True, "augmentation: horizontal flip with probability 1/2 (false for digits)")
    classes: list[str] | None = setting(None, "class names",
                                        none="Fashion-MNIST's for a folder named *fashion*, else 0..9")

    def validate(self) -> None:
        check_options(self)


def build_fashion_mnist(options: FashionMNISTOptions, family: str,
                        tokenizer: Any = None) -> ImageClassificationTask:
    root = Path(options.path).expanduser()
    if not root.is_dir():
        hint = f"; install it with: {FASHION_APT}" if str(root) == FASHION_DIR else ""
        raise ConfigError(f"no Fashion-MNIST data at {root}{hint} (or point task.path= at a folder with the "
                          "four IDX files)")
    d = load_idx_folder(root)
    images = np.concatenate([d["train_images"], d["test_images"]])[:, None]  # (N, 1, 28, 28)
    labels = np.concatenate([d["train_labels"], d["test_labels"]]).astype(np.int64)
    n_classes = int(labels.max()) + 1
    classes = options.classes or (list(FASHION_CLASSES) if n_classes == 10 and "fashion" in root.name.lower()
                                  else [str(i) for i in range(n_classes)])
    if len(classes) < n_classes:
        raise ConfigError(f"{len(classes)} class names for labels 0..{n_classes - 1}")
    n_train = len(d["train_labels"])
    return ImageClassificationTask(options, family, images, labels, classes, np.arange(n_train),
                                   np.arange(n_train, len(labels)), tokenizer)


@dataclass
class ImageFolderOptions:
    path: str = setting("", "a folder with one sub-folder of images per class; required")
    image_size: int = setting(32, "every image is resized to image_size x image_size", ge=1)
    channels: int = setting(3, "3 (RGB) or 1 (grey)", choices=(1, 3))
    dev_fraction: float = setting(0.1, "share of each class held out as val", gt=0, lt=1)
    split_seed: int = setting(0, "seeds the fixed train/dev split")
    seed: int = setting(0, "seeds the training stream")
    pad: int = setting(4, "augmentation: random crop of the image padded by this many pixels", ge=0)
    hflip: bool = setting(True, "augmentation: horizontal flip with probability 1/2")

    def validate(self) -> None:
        check_options(self)
        check_option(bool(self.path), "path", "is required: a folder with one sub-folder of images per class")


def build_image_folder(options: ImageFolderOptions, family: str,
                       tokenizer: Any = None) -> ImageClassificationTask:
    images, labels, classes = load_image_files(options.path, options.image_size, options.channels)
    train, val = stratified_split(labels, options.dev_fraction, options.split_seed)
    return ImageClassificationTask(options, family, images.transpose(0, 3, 1, 2), labels, classes, train, val,
                                   tokenizer)


register_task("fashion_mnist", FashionMNISTOptions, build_fashion_mnist, ("image",),
              "Fashion-MNIST (or MNIST) IDX files: 28x28 grey images, 10 classes", default_family="resnet")
register_task("image_folder", ImageFolderOptions, build_image_folder, ("image",),
              "a folder with one sub-folder of images per class (Pillow)", default_family="resnet")
