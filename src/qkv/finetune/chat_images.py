"""The chat recipe with images: instruction fine-tuning of a vision-language folder (Hugging Face llava,
idefics3 or smolvlm).

A record's message may carry images as OpenAI-style content parts, in reading order:

    {"messages": [{"role": "user", "content": [
                      {"type": "image_url", "image_url": {"url": "cat.png"}},
                      {"type": "text", "text": "What is in the picture?"}]},
                  {"role": "assistant", "content": "A cat."}]}

or, as LLaVA / ShareGPT / LLaMA-Factory data sets write them, as a top-level list with one <image> marker
per listed image in the text, in order (`attach_images` turns the markers into the parts above):

    {"messages": [{"role": "user", "content": "<image>\nWhat is in the picture?"},
                  {"role": "assistant", "content": "A cat."}], "images": ["cat.png"]}

The url is a file path, relative to the JSONL file (or absolute), or a `data:image/...;base64,` URL. A missing
file or an undecodable one is one error naming the file and line, before anything is trained.

Each conversation is rendered as `qkv chat --image` renders it: every message given to the chat template as a
list of parts ({"type": "image"} per image, then {"type": "text"}); the template writes one image token per
image, which becomes what the folder's processor writes for it: llava's `image_tokens` placeholders, or
Idefics3's text for the image's tiles (the patch embeddings replace the image tokens at the forward). Labels
are the text recipe's (the assistant's tokens and the end of turn), never the image tokens.

What trains (LLaVA's instruction-tuning stage): LoRA adapters on the language model (--lora; without it the
whole language model), the projector in full, the vision tower frozen. OUT is written by
its model type's exporter in the source's format.

Images are preprocessed once, when the data is read, and held in memory as float32 pixel tensors: LLaVA's one
3 x 336 x 336 tensor per image is 1.3 MB; an Idefics3 / SmolVLM image is up to 17 tiles of 3 x 364 x 364
(4 x 4 tiles and the global image: 27 MB at most, 1.6 MB a tile). Data sets of a few thousand LLaVA images,
or a few hundred large Idefics3 ones, fit; larger ones do not.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.config import ConfigError
from qkv.finetune.chat_tokens import IGNORE, encode_plain
from qkv.finetune.lora import apply_lora
from qkv.image_io import DEFAULT_LIMITS, open_image
from qkv.interop.llava import IMAGE_TOKEN
from qkv.interop.smolvlm import Idefics3Processor, folder_processor
from qkv.interop.tokenizer import has_generation_blocks, spans_to_token_mask
from qkv.models.vlm import LLaVA

IMAGE_PART = {"type": "image"}  # what the chat template reads; "url" (the source) is kept alongside
MARKER = "<image>"  # where a listed image goes in a record with a top-level "images" list


# -- reading ------------------------------------------------------------------------------------------------
def read_parts(content: list[Any], where: str) -> list[dict[str, Any]]:
    """A message's content parts, checked: [{"type": "text", "text"}, {"type": "image_url", "image_url":
    {"url"}}] -> [{"type": "text", "text"}, {"type": "image", "url"}]."""
    out: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else None
            if not isinstance(url, str) or not url:
                raise ConfigError(f"{where}: part {j}: an image_url part needs "
                                  '{"image_url": {"url": "file.png or data:..."}}')
            out.append({**IMAGE_PART, "url": url})
        else:
            raise ConfigError(f"{where}: part {j} must be {{\"type\": \"text\", \"text\": ...}} or "
                              '{"type": "image_url", "image_url": {"url": ...}}, '
                              f"got {part!r:.80}")
    return out


def attach_images(images: Any, messages: list[dict[str, Any]], where: str) -> None:
    """A record's top-level "images" list (LLaVA / ShareGPT / LLaMA-Factory's convention): each <image>
    marker in the messages' text, in reading order, becomes an image part holding the next listed file. The
    whitespace between a marker and its text is dropped: the chat template writes its own around an image
    part, so the record renders as the same record written with content parts."""
    if not isinstance(images, list) or not all(isinstance(u, str) and u for u in images):
        raise ConfigError(f"{where}: 'images' must be a list of image file paths, got {images!r:.80}")
    if images and any(isinstance(m["content"], list) for m in messages):
        raise ConfigError(f"{where}: give the images either as a top-level 'images' list with {MARKER} "
                          "markers or as image_url content parts, not both")
    # an empty list lists no images (LLaMA-Factory writes "images": [] on its text-only rows): content parts
    # may carry them, and a marker with nothing listed is still an error
    found = sum(m["content"].count(MARKER) for m in messages if isinstance(m["content"], str))
    if found != len(images):
        raise ConfigError(f"{where}: {found} {MARKER} marker(s) in the messages for {len(images)} "
                          f"image(s) in 'images' ({', '.join(images) or 'none'}): one marker per listed "
                          "image, in order")
    urls = iter(images)
    for m in messages:
        pieces = m["content"].split(MARKER) if isinstance(m["content"], str) else [m["content"]]
        if len(pieces) == 1:
            continue
        parts: list[dict[str, Any]] = []
        for j, piece in enumerate(pieces):
            if j:
                parts.append({**IMAGE_PART, "url": next(urls)})
                piece = piece.lstrip()
            if j < len(pieces) - 1:
                piece = piece.rstrip()
            if piece:
                parts.append({"type": "text", "text": piece})
        m["content"] = parts


def resolve_images(messages: list[dict[str, Any]], base: Path, where: str) -> None:
    """Each image part's url made absolute against `base` (the JSONL file's folder), the file required."""
    for m in messages:
        for part in m["content"] if isinstance(m["content"], list) else []:
            url = part.get("url")
            if part["type"] != "image" or url.startswith("data:"):
                continue
            path = (base / url).resolve()
            if not path.is_file():
                raise ConfigError(f"{where}: image {url!r}: no such file ({path})")
            part["url"] = str(path)


def has_images(messages: list[dict[str, Any]]) -> bool:
    return any(isinstance(m["content"], list) and any(p["type"] == "image" for p in m["content"])
               for m in messages)


def _open(url: str, where: str) -> Any:
    """A PIL image from a file path or a base64 data URL (qkv.image_io's limits)."""
    if not url.startswith("data:"):
        return open_image(url, f"{where}: {url}")
    head, _, payload = url.partition(",")
    if ";base64" not in head:
        raise ConfigError(f"{where}: a data URL image must be base64 (data:image/png;base64,...)")
    if len(payload) * 3 // 4 > DEFAULT_LIMITS.max_bytes:  # refused before it is decoded
        raise ConfigError(f"{where}: the data URL image is about {len(payload) * 3 // 4:,} bytes, over the "
                          f"limit of {DEFAULT_LIMITS.max_bytes:,}")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{where}: the data URL image is not valid base64") from None
    return open_image(raw, f"{where}: the data URL image")


# -- rendering ----------------------------------------------------------------------------------------------
@dataclass
class VisionData:
    """What rendering an image conversation needs of the model folder."""

    processor: Any  # qkv.interop.llava.ImageProcessor, or qkv.interop.smolvlm.Idefics3Processor (tiles)
    image_token_id: int
    image_tokens: int  # placeholders per image (per tile for Idefics3)
    image_token: str  # the image token's text (the plain transcript writes it)

    def expansion(self, tok: Any, image: Any) -> list[int]:
        """The ids that replace one image token for `image`: LLaVA's image_tokens placeholders, or the text
        Idefics3Processor writes for the image's tiles (qkv chat --image expands them the same way)."""
        if isinstance(self.processor, Idefics3Processor):
            return self.processor.image_ids(self.processor.grid(image), tok)
        return [self.image_token_id] * self.image_tokens


def vision_data(model: torch.nn.Module, folder: Path) -> VisionData | None:
    """The folder's image preprocessing when `model` is a vision-language model, else None."""
    if not isinstance(model, LLaVA):
        return None
    c, processor = model.config, folder_processor(folder)
    if isinstance(processor, Idefics3Processor) and processor.image_seq_len != c.image_tokens:
        raise ConfigError(f"{folder}: processor_config.json's image_seq_len ({processor.image_seq_len}) is "
                          f"not the model's {c.image_tokens} image tokens per tile")
    return VisionData(processor, c.image_token_id, c.image_tokens, IMAGE_TOKEN)


def _as_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every message's content as parts (multimodal templates iterate them), images without their url."""
    out = []
    for m in messages:
        c = m["content"]
        parts = [{"type": "text", "text": c}] if isinstance(c, str) else [
            IMAGE_PART if p["type"] == "image" else p for p in c]
        out.append({"role": m["role"], "content": parts})
    return out


def _text(m: dict[str, Any]) -> str:
    c = m["content"]
    return c if isinstance(c, str) else "".join(p["text"] for p in c if p["type"] == "text")


def _render(tok: Any, messages: list[dict[str, Any]], v: VisionData) -> tuple[list[int], list[int]]:
    """(ids, assistant mask) of one conversation, one image token per image."""
    if not tok.has_chat_template:  # qkv chat's plain transcript: the image token opens its message
        flat = [{"role": m["role"], "content": "".join(
            f"{v.image_token}\n" for p in m["content"] if p["type"] == "image") + _text(m)}
            if isinstance(m["content"], list) else m for m in messages]
        ids, labels = encode_plain(tok, flat)
        return ids, [int(x != IGNORE) for x in labels]
    parts = _as_parts(messages)
    if has_generation_blocks(tok.chat_template or ""):
        ids, mask = tok.apply_chat_template(parts, return_assistant_mask=True)
        return list(ids), list(mask)
    # no {% generation %} blocks: the assistant's text is located in the render (as for text records),
    # searched by each message's text
    text, _ = tok.render_chat(parts)
    spans = tok._assistant_spans(text, [{"role": m["role"], "content": _text(m)} for m in messages], {})
    ids, offsets = tok.encode_with_offsets(text, add_special_tokens=False)
    return list(ids), spans_to_token_mask(spans, offsets)


def encode_image_chat(tok: Any, messages: list[dict[str, Any]], v: VisionData,
                      where: str) -> tuple[list[int], list[int], Tensor | None]:
    """(ids, labels, pixel_values (n, C, H, W) or None) of one conversation: the image tokens expanded to
    image_tokens placeholders each, labels IGNORE on them and outside the assistant's tokens."""
    images = [p["url"] for m in messages if isinstance(m["content"], list)
              for p in m["content"] if p["type"] == "image"]
    ids, mask = _render(tok, messages, v)
    found = sum(i == v.image_token_id for i in ids)
    if found != len(images):
        raise ConfigError(f"{where}: the chat template wrote {found} image token(s) for {len(images)} "
                          "image(s): its template does not place the images of this record")
    pictures = [_open(u, where) for u in images]
    expansions = iter([v.expansion(tok, p) for p in pictures])
    out_ids: list[int] = []
    labels: list[int] = []
    for i, m in zip(ids, mask):
        if i == v.image_token_id:  # never learned: the image features replace (or frame) these tokens
            span = next(expansions)
            out_ids += span
            labels += [IGNORE] * len(span)
        else:
            out_ids.append(i)
            labels.append(i if m else IGNORE)
    return out_ids, labels, v.processor(pictures) if pictures else None


# -- the model: what trains -----------------------------------------------------------------------------
def prepare_vlm(model: torch.nn.Module, lora: Any) -> None:
    """LoRA (or full training) on the language model, the projector trained in full, the tower frozen."""
    if lora is not None:
        apply_lora(model.language_model, lora)
    model.vision.requires_grad_(False)
    model.projector.requires_grad_(True)
