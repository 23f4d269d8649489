"""A CLIP folder (Hugging Face `clip` or `siglip`, or a qkv CLIP checkpoint) as a feature extractor and a
zero-shot classifier.

    qkv embed CLIP_DIR --image a.png b.jpg --out img.npy       # (2, E) unit-length image embeddings
    qkv embed CLIP_DIR --text "a cat" "a dog" --out txt.npy    # (or --input texts.txt, one text per line)
    qkv embed CLIP_DIR --image *.png --query "a red car"       # the images nearest to a text
    qkv predict CLIP_DIR --image cat.png --labels "a cat,a dog" [--template "a photo of {}"]

Images are preprocessed as the folder's preprocessor_config.json says (CLIPImageProcessor: resize the shortest
edge, centre crop, rescale, normalise); texts are tokenized by its tokenizer.json. A text longer than the text
tower's context keeps its first tokens and its end-of-text token (OpenAI's `clip.tokenize(truncate=True)`),
because the tower reads the caption at that token. Zero-shot probabilities are the softmax over the labels of
exp(t) * cos(image, label text), CLIP's logits_per_image; with SigLIP each label's own sigmoid of
exp(t) * cos + b (they need not sum to 1), and its texts are padded to the context, as it was trained
(SiglipProcessor's padding="max_length"), because its text tower reads the final position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qkv.checkpoint import load_model
from qkv.config import ConfigError
from qkv.interop.llava import ImageProcessor, load_image
from qkv.interop.tokenizer import load_hf_tokenizer
from qkv.models.clip import CLIP
from qkv.storage import CheckpointError, read_config


@dataclass
class ClipFolder:
    model: CLIP
    tokenizer: Any  # interop.tokenizer.HFTokenizer
    processor: ImageProcessor


def is_clip_folder(folder: str | Path) -> bool:
    """Whether `folder`'s config.json describes a CLIP model (read without loading any weights)."""
    try:
        meta = read_config(Path(folder))
    except (CheckpointError, OSError):  # not a model folder at all: the caller's own loader says why
        return False
    return meta.get("model_type") in ("clip", "siglip") or meta.get("qkv_family") == "clip"


def open_clip(folder: str | Path, device: str = "cpu") -> ClipFolder:
    model = load_model(folder)
    if not isinstance(model, CLIP):
        raise ConfigError(f"{folder}: not a CLIP folder (it holds a {type(model).__name__})")
    if not (Path(folder) / "tokenizer.json").is_file():
        raise ConfigError(f"{folder}: no tokenizer.json (the folder's tokenizer tokenizes CLIP's texts)")
    processor = (ImageProcessor.from_folder(folder) if (Path(folder) / "preprocessor_config.json").is_file()
                 else ImageProcessor(size=model.config.vision.image_size,
                                     crop=(model.config.vision.image_size,) * 2))
    return ClipFolder(model.to(device).eval(), load_hf_tokenizer(folder), processor)


def tokenize(clip: ClipFolder, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (B, T) and mask (B, T) of `texts`, each cut to the text tower's context with its
    end-of-text token kept."""
    if not texts:
        raise ConfigError("no texts to embed")
    limit = clip.model.config.context_length
    rows = []
    for text in texts:
        if not text.strip():
            raise ConfigError("a text to embed is empty")
        ids = clip.tokenizer.encode(text, add_special_tokens=True)
        rows.append(ids if len(ids) <= limit else ids[:limit - 1] + ids[-1:])
    pad = clip.tokenizer.pad_token_id or 0
    if clip.model.config.text_pool == "final":  # SigLIP: every position attended, padding included
        ids = torch.tensor([r + [pad] * (limit - len(r)) for r in rows])
        return ids, torch.ones_like(ids)
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


def read_images(clip: ClipFolder, files: Sequence[str]) -> torch.Tensor:
    """(n, 3, H, W) pixel values of image files; a missing or unreadable file is a ConfigError naming it."""
    if not files:
        raise ConfigError("no image files given")
    try:
        images = [load_image(f) for f in files]
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return clip.processor(images)


@torch.no_grad()
def image_embeddings(clip: ClipFolder, files: Sequence[str], batch_size: int = 32) -> np.ndarray:
    """(n, E) float32 unit-length embeddings of image files."""
    p = next(clip.model.parameters())
    out = [clip.model.encode_image(read_images(clip, files[s:s + batch_size]).to(p.device, p.dtype))
           for s in range(0, len(files), batch_size)]
    return torch.cat(out).float().cpu().numpy()


@torch.no_grad()
def text_embeddings(clip: ClipFolder, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
    """(n, E) float32 unit-length embeddings of texts."""
    device = next(clip.model.parameters()).device
    out = []
    for s in range(0, len(texts), batch_size):
        ids, mask = tokenize(clip, texts[s:s + batch_size])
        out.append(clip.model.encode_text(ids.to(device), mask.to(device)))
    return torch.cat(out).float().cpu().numpy()


def parse_labels(labels: str | None) -> list[str]:
    """--labels "a cat,a dog" -> ["a cat", "a dog"]: at least two, none empty, no repeats."""
    names = [x.strip() for x in (labels or "").split(",")]
    if not labels or not any(names):
        raise ConfigError('--labels is empty: give the classes as "a cat,a dog"')
    if any(not n for n in names):
        raise ConfigError(f"--labels {labels!r} has an empty class between commas")
    if len(names) < 2:
        raise ConfigError(f"--labels {labels!r} names one class; zero-shot classification needs two or more")
    if len(set(names)) < len(names):
        raise ConfigError(f"--labels {labels!r} names a class twice")
    return names


def zero_shot(folder: str | Path, images: Sequence[str], labels: str | None, *, template: str = "{}",
              top_k: int = 5) -> list[tuple[str, list[tuple[str, float]]]]:
    """[(image, [(label, probability)] best first)] for each image file."""
    names = parse_labels(labels)
    if "{}" not in template:
        raise ConfigError(f"--template {template!r} has no {{}} for the label")
    if top_k < 1:
        raise ConfigError(f"--top-k must be at least 1, got {top_k}")
    clip = open_clip(folder)
    img = torch.from_numpy(image_embeddings(clip, images))
    txt = torch.from_numpy(text_embeddings(clip, [template.format(n) for n in names]))
    with torch.no_grad():
        logits = clip.model.similarity_logits(img, txt)
        probs = logits.sigmoid() if clip.model.config.sigmoid else logits.softmax(-1)
    top = probs.topk(min(top_k, len(names)), dim=-1)
    return [(f, [(names[int(i)], float(p)) for p, i in zip(top.values[b], top.indices[b])])
            for b, f in enumerate(images)]


__all__ = ["ClipFolder", "image_embeddings", "is_clip_folder", "open_clip", "parse_labels", "text_embeddings",
           "tokenize", "zero_shot"]
