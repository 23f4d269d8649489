"""Images in Engine requests (a LLaVA model's image inputs): where they sit in the prompt, their prefix-cache
keys, and their projected embeddings, encoded once per content hash.

    engine.add_request(ids, 32, images=[ImageInput(pixel_values, key=sha256_of_the_image_bytes)])

The prompt holds the placeholder ids already expanded (interop.llava.expand_image_tokens): image i takes
the next `length` placeholders in reading order (LLaVA: image_tokens; an Idefics3 image split into tiles:
image_tokens per tile). At the prefill those positions take the image's projected embeddings instead of a
token embedding (LLaVA.step_with_images); a chunk may hold any part of an image's placeholders. Decoding
never sees the image again: it is in the KV cache.

Prefix caching: a full block's key also hashes the keys of the images whose placeholders fall in it (vLLM's
"extra keys"), so two requests with the same text and image share blocks and a different image never
matches. Embeddings: an LRU of projected embeddings by content hash (EngineConfig.image_cache), so a repeated
image skips the vision tower even when its blocks were evicted; an image whose placeholders all lie in
cached blocks is never encoded at all.

Checks: add_request refuses an image whose pixels are not the vision tower's (C, H, W) or whose embeddings
are not the decoder's width (check_images), so a bad image never reaches a step; a vision tower that raises
while encoding fails only the requests whose images it could not encode (Engine._encode_images).
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class ImageInput:
    """One image of a request: its pixels (n_tiles, C, H, W) or (C, H, W), or its projected embeddings
    (N, d) computed elsewhere; `key` names its content (e.g. the SHA-256 of the image file's bytes and the
    preprocessing settings). key None: the SHA-256 of the pixel values / embeddings themselves."""

    pixel_values: Tensor | None = None
    features: Tensor | None = None
    key: bytes | str | None = None

    def __post_init__(self) -> None:
        if (self.pixel_values is None) == (self.features is None):
            raise ValueError("an ImageInput takes pixel_values or features (one of them)")
        if self.pixel_values is not None and self.pixel_values.dim() == 3:
            self.pixel_values = self.pixel_values.unsqueeze(0)
        if self.pixel_values is not None and self.pixel_values.dim() != 4:
            raise ValueError(f"pixel_values must be (n_tiles, C, H, W) or (C, H, W), got "
                             f"{tuple(self.pixel_values.shape)}")
        if self.features is not None and self.features.dim() != 2:
            raise ValueError(f"features must be (N, d), got {tuple(self.features.shape)}")

    def digest(self) -> bytes:
        """32 bytes naming the image's content (the prefix cache's extra key, the LRU's key)."""
        t = self.pixel_values if self.pixel_values is not None else self.features
        # the shape is hashed with a given key too: one key with another tile count takes other placeholders
        # (and other embeddings), so it must name other blocks and another LRU entry
        head = f"{'pixels' if self.features is None else 'features'}:{tuple(t.shape)}:".encode()
        if self.key is not None:
            raw = self.key.encode() if isinstance(self.key, str) else bytes(self.key)
            return hashlib.sha256(b"image:" + head + raw).digest()
        t = t.detach().to("cpu").contiguous()
        return hashlib.sha256(head + f"{t.dtype}:".encode() + t.view(torch.uint8).numpy().tobytes()).digest()


@dataclass(eq=False)
class Span:
    """An image of a request: its key, the prompt positions of its placeholders, its embeddings once
    encoded (kept while the request lives: a preempted request recomputes without the vision tower)."""

    key: bytes
    positions: list[int]
    pixels: Tensor | None = None
    features: Tensor | None = None


def check_images(images: Sequence[ImageInput], pixel_shape: tuple[int, int, int], width: int,
                 per_tile: int) -> None:
    """ValueError unless every image fits the model: pixels of (C, H, W) = pixel_shape (the vision tower's
    input; an Idefics3 tile), features of `width` columns (the decoder's d_model) and a whole number of
    per_tile rows. Checked where a request enters, so a bad image never reaches a step (where it would
    stop the engine, or fill the wrong rows)."""
    for i, im in enumerate(images):
        if im.pixel_values is not None and tuple(im.pixel_values.shape[1:]) != tuple(pixel_shape):
            raise ValueError(f"image {i}: pixel_values must be (n_tiles, {', '.join(map(str, pixel_shape))}) "
                             f"(the vision tower's input), got {tuple(im.pixel_values.shape)}")
        if im.features is not None and (im.features.shape[1] != width or not im.features.shape[0]
                                        or im.features.shape[0] % per_tile):
            raise ValueError(f"image {i}: features must be (k * {per_tile}, {width}) (k images or tiles of "
                             f"{per_tile} embeddings of the decoder's width), got {tuple(im.features.shape)}")


def spans(prompt: list[int], images: Sequence[ImageInput], placeholder: int, per_tile: int) -> list[Span]:
    """The images' placeholder positions in the prompt: image i takes the next length(i) placeholders;
    ValueError unless the counts match."""
    at = [i for i, t in enumerate(prompt) if t == placeholder]
    lengths = [im.features.shape[0] if im.features is not None else im.pixel_values.shape[0] * per_tile
               for im in images]
    if len(at) != sum(lengths):
        raise ValueError(f"the prompt holds {len(at)} image placeholder tokens (id {placeholder}) but its "
                         f"{len(images)} image(s) take {sum(lengths)} ({per_tile} per image or tile): "
                         "expand each image's token to its placeholders "
                         "(qkv.interop.llava.expand_image_tokens)")
    out, i = [], 0
    for im, n in zip(images, lengths):
        out.append(Span(im.digest(), at[i:i + n], im.pixel_values, im.features))
        i += n
    return out


def block_extras(images: list[Span], block_size: int) -> dict[int, bytes]:
    """{block index: the keys of the images with a placeholder in that block, in order}: what a full
    block's prefix-cache key hashes besides its tokens."""
    out: dict[int, list[bytes]] = {}
    for s in images:
        for b in sorted({p // block_size for p in s.positions}):
            out.setdefault(b, []).append(s.key)
    return {b: b"".join(keys) for b, keys in out.items()}


def in_piece(images: list[Span], start: int, n: int) -> list[tuple[Span, int, int]]:
    """The images with placeholders in prompt positions [start, start + n): (span, lo, hi), its placeholders
    lo..hi-1 lying there."""
    out = []
    for s in images:
        lo, hi = bisect_left(s.positions, start), bisect_left(s.positions, start + n)
        if lo < hi:
            out.append((s, lo, hi))
    return out


@dataclass
class ImageEncoder:
    """The model's vision tower + projector behind an LRU of projected embeddings by content hash."""

    model: Any  # a LLaVA (image_features, step_with_images)
    capacity: int = 32
    cache: OrderedDict = field(default_factory=OrderedDict)
    encoded: int = 0  # images run through the vision tower
    hits: int = 0  # images found in the LRU

    def _lookup(self, key: bytes) -> Tensor | None:
        f = self.cache.get(key)
        if f is not None:
            self.cache.move_to_end(key)
            self.hits += 1
        return f

    def _keep(self, key: bytes, features: Tensor) -> None:
        if self.capacity <= 0:
            return
        self.cache[key] = features
        self.cache.move_to_end(key)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)

    def ensure(self, images: list[Span]) -> None:
        """Every span's embeddings: from the LRU, or one vision forward per pixel shape for the rest (the
        same image twice in the batch is encoded once)."""
        todo: dict[bytes, list[Span]] = {}
        for s in images:
            if s.features is None:
                s.features = self._lookup(s.key)
            if s.features is None:
                todo.setdefault(s.key, []).append(s)
        by_shape: dict[tuple, list[bytes]] = {}
        for key, group in todo.items():
            by_shape.setdefault(tuple(group[0].pixels.shape[1:]), []).append(key)
        for keys in by_shape.values():
            pix = [todo[k][0].pixels for k in keys]
            feats = self.model.image_features(torch.cat(pix))  # (tiles, N', d)
            rows = feats.reshape(-1, feats.shape[-1]).split([p.shape[0] * feats.shape[1] for p in pix])
            for k, view in zip(keys, rows):
                # a copy: a view would keep the whole batch's embeddings alive in the LRU, past its bound
                f = view.clone()
                self.encoded += 1
                self._keep(k, f)
                for s in todo[k]:
                    s.features, s.pixels = f, None

    def chunk(self, pieces: list[tuple[list[Span], int, int]], device: Any) -> tuple[Tensor, Tensor] | None:
        """For B prefill pieces (a request's images, its first position, the piece's length T): the (B, T)
        mask of the placeholder positions and their embeddings in reading order; None when no piece holds
        one."""
        T = pieces[0][2]
        where = torch.zeros(len(pieces), T, dtype=torch.bool)
        parts: list[tuple[Span, int, int]] = []
        for row, (images, start, n) in enumerate(pieces):
            for s, lo, hi in in_piece(images, start, n):
                where[row, [p - start for p in s.positions[lo:hi]]] = True
                parts.append((s, lo, hi))
        if not parts:
            return None
        self.ensure([s for s, _, _ in parts])
        # parts are in reading order: row by row, and in a row image by image (image i takes the
        # placeholders before image i + 1's)
        feats = torch.cat([s.features[lo:hi] for s, lo, hi in parts])
        return where.to(device), feats.to(device)
