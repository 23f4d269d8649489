"""`qkv predict DETECTOR --image FILE --out FILE.png`: a DETR's boxes on an image, listed and drawn.

DETECTOR is a qkv run trained on the detection task (its canvas size and pixel normalisation, Fashion-MNIST's
class names), a bare qkv DETR folder (resized to the backbone's image_size, pixels in [0, 1], classes
numbered), or a Hugging Face `detr` folder (preprocessor_config.json's resizing and normalisation,
config.json's id2label). Every query whose best non-empty class has probability >= threshold is a detection
(DETR needs no non-maximum suppression: the set loss taught its queries not to repeat each other). Boxes come
back in the input image's pixels; the drawing is the image, enlarged to at least DRAW_SIDE pixels so that the
labels can be read, with one coloured box and "class score" per detection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw, ImageFont

from qkv.config import ConfigError
from qkv.image_io import open_image
from qkv.predict import ImagePreprocessor, hf_meta
from qkv.run import load_model_any, load_run_task, model_folder, run_folder_of
from qkv.storage import CheckpointError, read_config
from qkv.tasks.detection import detections

DRAW_SIDE = 256  # the shorter side of a drawing, at least (a 64 px canvas is drawn 4x)
# matplotlib's tab10: ten colours told apart easily, one per class (cycled beyond ten)
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")


@dataclass
class Detection:
    label: str
    score: float
    box: tuple[float, float, float, float]  # (x0, y0, x1, y1) in the input image's pixels


def is_detector(path: str | Path) -> bool:
    """Whether `path` (a model folder or a run) holds a DETR, read from its config.json without loading
    weights."""
    try:
        meta = read_config(model_folder(path))
    except (CheckpointError, ConfigError, OSError):  # not a model folder: the classifier's loader says why
        return False
    return meta.get("qkv_family") == "detr" or meta.get("model_type") == "detr"


def detector_preprocessing(path: str | Path, model: Any) -> tuple[ImagePreprocessor, list[str]]:
    """The preprocessing and class names of a DETR folder or run (see the module docstring)."""
    c = model.config
    channels, side, n = c.backbone.n_channels, c.backbone.image_size, c.num_labels
    folder = model_folder(path)
    meta = hf_meta(folder)
    pre = ImagePreprocessor(channels, size=(side, side))
    if meta is not None:
        pre_file = folder / "preprocessor_config.json"
        if pre_file.is_file():
            pre = ImagePreprocessor.from_hf(read_config(pre_file), channels)
        labels = meta.get("id2label") or {}
        return pre, [str(labels.get(str(i), labels.get(i, f"LABEL_{i}"))) for i in range(n)]
    if run_folder_of(path) is None:
        return pre, [str(i) for i in range(n)]
    task = load_run_task(path)
    pre.mean, pre.std = [float(task.mean)] * channels, [float(task.std)] * channels
    return pre, list(task.classes)


def detect(path: str | Path, image_files: list[str],
           threshold: float = 0.5) -> list[tuple[Any, list[Detection]]]:
    """Per image file, (the decoded image, its detections scoring >= threshold, best first). Every file is
    read before the model is loaded."""
    if not 0.0 <= threshold <= 1.0:
        raise ConfigError(f"--threshold must be in [0, 1], got {threshold}")
    images = [open_image(Path(f), str(f)) for f in image_files]
    model = load_model_any(path)
    if getattr(model, "kind", None) != "detection":
        raise ConfigError(f"{path}: not a detector (it holds {type(model).__name__}); boxes need a DETR")
    model.eval()
    pre, names = detector_preprocessing(path, model)
    dtype = next(model.parameters()).dtype
    out = []
    for image in images:  # one at a time: a Hugging Face processor keeps each image's aspect ratio
        with torch.no_grad():
            o = model(pre(image)[None].to(dtype))
        boxes, scores, labels = detections(o.logits, o.pred_boxes, image.width, image.height, threshold)[0]
        found = [Detection(names[int(i)], float(s), tuple(float(v) for v in b))
                 for b, s, i in zip(boxes, scores, labels)]
        out.append((image, sorted(found, key=lambda d: -d.score)))
    return out


def draw(image: Any, found: list[Detection]) -> Any:
    """An RGB copy of `image`, enlarged to at least DRAW_SIDE pixels on its shorter side, with each
    detection's box and "label score" drawn in its class's colour."""
    k = max(1, math.ceil(DRAW_SIDE / min(image.width, image.height)))
    canvas = image.convert("RGB").resize((image.width * k, image.height * k), Image.Resampling.NEAREST)
    pen = ImageDraw.Draw(canvas)
    font = ImageFont.load_default()
    order = sorted({d.label for d in found})
    for d in found:
        colour = COLOURS[order.index(d.label) % len(COLOURS)]
        x0, y0, x1, y1 = (v * k for v in d.box)
        pen.rectangle((x0, y0, x1 - 1, y1 - 1), outline=colour, width=2)
        text = f"{d.label} {d.score:.2f}"
        left, top, right, bottom = pen.textbbox((x0, y0), text, font=font)
        ty = y0 - (bottom - top) - 2 if y0 - (bottom - top) - 2 >= 0 else y1  # above the box, else below it
        pen.rectangle((x0, ty, x0 + right - left + 2, ty + bottom - top + 2), fill=colour)
        pen.text((x0 + 1, ty + 1 - (top - y0)), text, fill="white", font=font)
    return canvas


def format_detections(image_file: str, found: list[Detection], threshold: float) -> list[str]:
    if not found:
        return [f"{image_file}: no object scored >= {threshold:.2f}"]
    return [image_file] + [f"  {d.score:6.4f}  {d.label:<12}  box " + " ".join(f"{v:.1f}" for v in d.box)
                           for d in found]


def drawing_format(out: str | Path) -> str:
    """Pillow's format for the file `out` (from its suffix), checked before any work; its folder must
    exist."""
    out = Path(out)
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: folder {out.parent} does not exist")
    fmt = Image.registered_extensions().get(out.suffix.lower())
    if fmt is None or fmt not in Image.SAVE:
        raise ConfigError(f"--out {out}: no image format for suffix {out.suffix or '(none)'!r}; use .png or "
                          ".jpg")
    return fmt


def save_drawing(drawing: Any, out: str | Path) -> Path:
    """Write the drawing to `out` (its format from the suffix: .png, .jpg, ...) through a temporary file, so
    that an interrupted write leaves no half image under the name."""
    out = Path(out)
    fmt = drawing_format(out)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        drawing.save(tmp, format=fmt)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
