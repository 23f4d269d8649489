"""`qkv attention`'s report: attention maps of every layer x head (PNG grids) and the per-head entropy table,
or for a ViT the last layer's attention drawn over held-out images of the run's task."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from qkv.config import ConfigError
from qkv.experiments import attention_from_checkpoint
from qkv.experiments.vlm_attention import vlm_attention_report
from qkv.models import vit
from qkv.models.vlm import LLaVA
from qkv.run import load_model_any, load_run_task, model_folder

# families with no attention map to draw, and why (qkv attention and qkv explore refuse them alike)
UNSUPPORTED = {
    "lstm": "an LSTM has no attention to show",
    "resnet": "a ResNet is a convolutional network: it has no attention to show",
    "swin": "Swin attends within shifted windows; the explorer shows full attention maps only",
    "clip": "CLIP is a two-tower model; explore its towers as separate ViT / text models",
}



def attention_report(path: str | Path, text: str, out_png: Path, target: str | None = None, *,
                     image: str | None = None, layer: int | None = None,
                     token: int | None = None) -> list[str]:
    """Attention maps of every layer x head for `text` (PNG grids) and the per-head entropy table: the lines
    `qkv attention` prints. Warnings are said as the CLI says things, one line on stderr. image (with layer,
    token): a vision-language model's answer to `text` over that image (experiments.vlm_attention)."""
    model = load_model_any(path)
    family = getattr(model, "family", "") or type(model).__name__.lower()
    if family in UNSUPPORTED:  # the same refusals as qkv explore's
        raise ConfigError(f"{path}: {UNSUPPORTED[family]}")
    if model.kind == "audio":
        raise ConfigError(f"{path}: qkv attention draws text and image models; for an audio model use qkv "
                          "explore "
                          f"{path} (the page, or --wav FILE --export PAGE.html; a DTMF run renders typed "
                          "digits)")
    if image is not None or layer is not None or token is not None:
        return _image_question(model, path, text, out_png, image, layer, token)
    if model.kind == "image":
        return _vit_overlay(model, path, text, out_png)

    with warnings.catch_warnings(record=True) as caught:  # said as the CLI says things: one line on stderr
        warnings.simplefilter("always")
        res = attention_from_checkpoint(model_folder(path), text, out_png, target=target, model=model)
    for w in caught:
        print(f"qkv: warning: {w.message}", file=sys.stderr)
    wrote = [*res.pngs, *([res.json_path] if res.json_path is not None else [])]
    return [f"wrote {p}" for p in wrote] + [res.entropy_table()]


def _image_question(model: Any, path: str | Path, text: str, out_png: Path, image: str | None,
                    layer: int | None, token: int | None) -> list[str]:
    if image is None:
        raise ConfigError("--layer and --token go with --image (a vision-language model's answer over an "
                          "image)")
    if not isinstance(model, LLaVA):
        raise ConfigError("--image needs a vision-language model folder (a Hugging Face llava folder); "
                          f"{path} holds a {type(model).__name__}")
    return vlm_attention_report(model, model_folder(path), text, image, out_png, layer=layer, token=token)


VIT_MAX_IMAGES = 32  # one row of images in one figure: wider than this is unreadable


def _vit_overlay(model: Any, path: str | Path, text: str, out_png: Path) -> list[str]:
    """ViT: attention of the last layer over the patches, drawn on the first N held-out images of the run's
    task, in order (`--input N`, default 8, at most VIT_MAX_IMAGES and the held-out images there are), titled
    with predicted / true class."""

    if not isinstance(model, vit.ViT):
        raise ConfigError(f"attention overlays are drawn for ViT models, not {type(model).__name__}")
    try:
        n = int(text) if text.strip() else 8
    except ValueError:
        raise ConfigError("for a ViT, --input is the number of held-out images to show (e.g. --input 8)") \
            from None
    task = load_run_task(path)
    # the digits task: the held-out images, in order
    if hasattr(task, "split_indices") and hasattr(task, "images"):
        held_out = task.split_indices("val")
        available = min(len(held_out), VIT_MAX_IMAGES)
        what = f"the task has {len(held_out)} held-out images" if len(held_out) < VIT_MAX_IMAGES else \
            f"at most {VIT_MAX_IMAGES} fit one figure"
    else:  # another image task: only its batch sampler
        held_out, available, what = None, VIT_MAX_IMAGES, f"at most {VIT_MAX_IMAGES} fit one figure"
    if not 1 <= n <= available:
        raise ConfigError(f"for a ViT, --input is the number of held-out images to show, 1..{available} "
                          f"({what}), got {n}")
    if held_out is not None:
        idx = held_out[:n]
        px = task.images[idx]
        # the image tasks store raw uint8 pixels
        px = task.normalize(px) if hasattr(task, "normalize") else px
        batch = {"pixel_values": px, "labels": task.labels[idx]}
    else:
        batch = task.batch(0, n, "val")
    model.eval()
    with torch.no_grad():
        pred = model(pixel_values=batch["pixel_values"]).logits.argmax(-1)
    classes = getattr(task, "classes", None)
    names = [classes[int(i)] if classes else str(int(i)) for i in pred]
    truth = [classes[int(i)] if classes else str(int(i)) for i in batch["labels"]]
    out_png.parent.mkdir(parents=True, exist_ok=True)
    vit.save_attention_overlay(model, batch["pixel_values"], str(out_png),
                           titles=[f"pred {p} / true {t}" for p, t in zip(names, truth)])
    return [f"wrote {out_png}"]
