"""`qkv predict MODEL IMAGE...`: an image classifier's top classes for image files, with probabilities; and
`qkv predict MODEL --text "... [MASK] ..."`: a masked-LM folder's top tokens for each mask (fill_mask). A CLIP
folder's zero-shot classes (--labels) are qkv.image_text's.

MODEL is a Hugging Face image-classification folder (ViT, ResNet: preprocessing from its
preprocessor_config.json, class names from config.json's id2label) or a qkv run trained on an image task (its
task's image size, channels, normalisation and class names), or a bare qkv checkpoint folder (resized to the
model's image_size, pixels in [0, 1], classes numbered).

The Hugging Face preprocessing is transformers' PIL one, step by step: convert to RGB, resize with the
folder's resampling filter (to size height x width; or the shortest edge to shortest_edge, and with ConvNext's
crop_pct to shortest_edge / crop_pct first), centre crop (crop_pct, or do_center_crop to crop_size), rescale
(x rescale_factor), normalise (image_mean, image_std).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from qkv.checkpoint import load_model
from qkv.config import ConfigError
from qkv.image_io import open_image
from qkv.interop.tokenizer import load_hf_tokenizer
from qkv.run import load_model_any, load_run_task, model_folder, run_folder_of


@dataclass
class ImagePreprocessor:
    channels: int = 3
    size: tuple[int, int] | None = None  # resize to (height, width)
    shortest_edge: int | None = None  # or: resize the shortest edge to this, keeping the aspect ratio
    crop_pct: float | None = None  # ConvNext: shortest edge to shortest_edge / crop_pct, then a centre crop
    crop: tuple[int, int] | None = None  # centre crop (height, width) after resizing
    resample: int = 2  # PIL filter number (2 bilinear, 3 bicubic)
    rescale: float | None = 1 / 255
    mean: list[float] | None = None
    std: list[float] | None = None

    @classmethod
    def from_hf(cls, pre: dict[str, Any], channels: int) -> ImagePreprocessor:
        """From a preprocessor_config.json (ViTImageProcessor, ConvNextImageProcessor,
        BitImageProcessor...)."""
        size, crop = pre.get("size") or {}, pre.get("crop_size") or {}
        if isinstance(size, int):
            size = {"shortest_edge": size}
        out = cls(channels=channels, resample=int(pre.get("resample", 2)))
        if pre.get("do_resize", True):
            if "height" in size and "width" in size:
                out.size = (int(size["height"]), int(size["width"]))
            elif "shortest_edge" in size:
                out.shortest_edge = int(size["shortest_edge"])
                if "crop_pct" in pre and out.shortest_edge < 384:  # ConvNext's rule: crop only below 384
                    out.crop_pct = float(pre["crop_pct"])
                elif "crop_pct" in pre:
                    out.size, out.shortest_edge = (out.shortest_edge, out.shortest_edge), None
            else:
                raise ConfigError(f"preprocessor_config.json: unsupported size {size!r}")
        if pre.get("do_center_crop") and crop:
            out.crop = (int(crop["height"]), int(crop["width"]))
        out.rescale = float(pre.get("rescale_factor", 1 / 255)) if pre.get("do_rescale", True) else None
        if pre.get("do_normalize", True) and "image_mean" in pre:
            out.mean, out.std = list(pre["image_mean"]), list(pre.get("image_std")
                                                                  or [1.0] * len(pre["image_mean"]))
        return out

    def __call__(self, image: Any) -> Tensor:
        """A PIL image -> (C, H, W) float32."""
        im = image.convert("L" if self.channels == 1 else "RGB")
        if self.size is not None:
            im = im.resize((self.size[1], self.size[0]), Image.Resampling(self.resample))
        elif self.shortest_edge is not None:
            edge = int(self.shortest_edge / self.crop_pct) if self.crop_pct else self.shortest_edge
            w, h = im.size
            short, long = min(w, h), max(w, h)
            new_long = int(edge * long / short)
            im = im.resize((edge, new_long) if w <= h else (new_long, edge), Image.Resampling(self.resample))
        crop = (self.shortest_edge, self.shortest_edge) if self.crop_pct else self.crop
        if crop is not None:
            w, h = im.size
            top, left = (h - crop[0]) // 2, (w - crop[1]) // 2
            im = im.crop((left, top, left + crop[1], top + crop[0]))
        x = np.asarray(im, dtype=np.float32).reshape(im.size[1], im.size[0], self.channels)
        if self.rescale is not None:
            x = x * np.float32(self.rescale)
        if self.mean is not None:
            x = (x - np.asarray(self.mean, np.float32)[: self.channels]) / np.asarray(self.std,
                                                                                      np.float32)[
                                                                                          : self.channels]
        return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))


def hf_meta(folder: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and "qkv_family" not in meta else None


def preprocessing_for(path: str | Path, model: Any) -> tuple[ImagePreprocessor, list[str]]:
    """The preprocessing and class names of a model folder or run (see the module docstring)."""
    c = model.config
    n = int(c.num_labels)
    folder = model_folder(path)
    meta = hf_meta(folder)
    if meta is not None:  # a Hugging Face folder
        pre_file = folder / "preprocessor_config.json"
        if pre_file.is_file():
            pre = ImagePreprocessor.from_hf(json.loads(pre_file.read_text(encoding="utf-8")), c.n_channels)
        else:
            pre = ImagePreprocessor(c.n_channels, size=(c.image_size, c.image_size))
        labels = meta.get("id2label") or {}
        return pre, [str(labels.get(str(i), labels.get(i, f"LABEL_{i}"))) for i in range(n)]
    pre = ImagePreprocessor(c.n_channels, size=(c.image_size, c.image_size))
    if run_folder_of(path) is None:  # a qkv model folder; qkv finetune writes its preprocessing and classes
        pre_file, done = folder / "preprocessor_config.json", folder / "finetune.json"
        if pre_file.is_file():
            pre = ImagePreprocessor.from_hf(json.loads(pre_file.read_text(encoding="utf-8")), c.n_channels)
        labels = json.loads(done.read_text(encoding="utf-8")).get("labels") if done.is_file() else None
        named = isinstance(labels, list) and len(labels) == n
        return pre, [str(x) for x in labels] if named else [str(i) for i in range(n)]

    task = load_run_task(path)
    if hasattr(task, "mean"):  # the image tasks' per-channel normalisation
        pre.mean, pre.std = task.mean.flatten().tolist(), task.std.flatten().tolist()
    return pre, list(getattr(task, "classes", None) or [str(i) for i in range(n)])


def predict_images(path: str | Path, images: list[str],
                   top_k: int = 5) -> list[tuple[str, list[tuple[str, float]]]]:
    """[(image, [(class name, probability)] * top_k)] for each image file."""
    if top_k < 1:
        raise ConfigError(f"--top-k must be at least 1, got {top_k}")
    files = [Path(f) for f in images]
    for f in files:  # every file checked before the model is loaded
        if not f.is_file():
            raise ConfigError(f"image not found: {f}")
    model = load_model_any(path)
    if getattr(model, "kind", None) != "image" or getattr(model, "classifier", None) is None:
        raise ConfigError(f"{path}: qkv predict needs an image classifier (a ViT, Swin or ResNet with a "
                          f"classification head), not {type(model).__name__}")
    model.eval()
    pre, names = preprocessing_for(path, model)
    pixels = []
    for f in files:
        pixels.append(pre(open_image(f, str(f))))
    if len({tuple(p.shape) for p in pixels}) > 1:  # shortest-edge resizing without a crop keeps aspect ratios
        return [row for f in images for row in predict_images(path, [f], top_k)]
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        probs = model(torch.stack(pixels).to(dtype)).logits.float().softmax(-1)
    k = min(top_k, probs.shape[-1])
    top = probs.topk(k, dim=-1)
    return [(img, [(names[int(i)], float(p)) for p, i in zip(top.values[b], top.indices[b])])
            for b, img in enumerate(images)]


def format_predictions(rows: list[tuple[str, list[tuple[str, float]]]]) -> list[str]:
    lines = []
    for img, top in rows:
        lines.append(img)
        lines += [f"  {p:6.4f}  {name}" for name, p in top]
    return lines


MASK_NAMES = ("[MASK]", "<mask>")


def fill_mask(path: str | Path, texts: list[str],
              top_k: int = 5) -> list[tuple[str, list[list[tuple[str, float]]]]]:
    """[(text, [[(token, probability)] * top_k for each mask token in the text])] from a masked-LM folder
    (a Hugging Face *ForMaskedLM, or qkv finetune --task mlm's OUT) and its tokenizer."""
    if top_k < 1:
        raise ConfigError(f"--top-k must be at least 1, got {top_k}")
    model = load_model(path)
    if getattr(model.config, "head", None) != "mlm":
        raise ConfigError(f"{path}: --text fills masks with a masked-LM folder (BertForMaskedLM, "
                          f"RobertaForMaskedLM, ...); this one holds {type(model).__name__} with head "
                          f"{getattr(model.config, 'head', None)!r}")
    tok = load_hf_tokenizer(path)
    named = tok.special_tokens.get("mask_token")
    mask = next((i for i in (tok.token_to_id(n) for n in [named, *MASK_NAMES] if n) if i is not None), None)
    if mask is None:
        raise ConfigError(f"{path}: its tokenizer has no mask token")
    model.eval()
    rows = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=True)
        where = [k for k, i in enumerate(ids) if i == mask]
        if not where:
            raise ConfigError(f"{text!r} has no {tok.id_to_token(mask)} to fill")
        with torch.no_grad():
            probs = model(torch.tensor([ids])).logits[0, where].float().softmax(-1)
        top = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
        rows.append((text, [[(tok.decode([int(i)]).strip(), float(p)) for p, i in zip(v, ix)]
                            for v, ix in zip(top.values, top.indices)]))
    return rows


def format_fills(rows: list[tuple[str, list[list[tuple[str, float]]]]]) -> list[str]:
    lines = []
    for text, masks in rows:
        lines.append(text)
        for n, options in enumerate(masks, 1):
            lines += [f"  mask {n}: {p:6.4f}  {token}" for token, p in options]
    return lines
