"""Batch helpers: length truncation with a counted warning, device moves, token counts.

The seeds' "loss suddenly NaN" story ended with truncating over-long sequences; here a sequence longer
than the model's context is cut to it, and every cut is counted and warned about, never silent.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

# keys holding (B, T) token-aligned tensors that may be cut along T
SEQUENCE_KEYS = ("input_ids", "labels", "attention_mask", "token_type_ids", "decoder_input_ids",
                 "decoder_attention_mask", "position_ids")


class LengthTruncationWarning(UserWarning):
    """A batch held sequences longer than the model's context; they were truncated."""


def truncate_batch(batch: dict[str, Any], max_len: int | None) -> tuple[dict[str, Any], int]:
    """Cut every (B, T > max_len) tensor under SEQUENCE_KEYS to its first max_len positions.

    Returns the (possibly new) batch and how many tensors were cut. A cut emits LengthTruncationWarning
    naming the keys and lengths; the trainer also counts cuts in its metrics (`truncated`)."""
    if max_len is None:
        return batch, 0
    cut = {}
    out = dict(batch)
    for key in SEQUENCE_KEYS:
        t = batch.get(key)
        if isinstance(t, Tensor) and t.dim() >= 2 and t.shape[1] > max_len:
            cut[key] = t.shape[1]
            out[key] = t[:, :max_len]
    if cut:
        desc = ", ".join(f"{k} ({n} -> {max_len})" for k, n in cut.items())
        warnings.warn(f"truncated sequences longer than the model's context of {max_len}: {desc}",
                      LengthTruncationWarning, stacklevel=2)
    return out, len(cut)


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: move(v, device) for k, v in batch.items()}


def move(value: Any, device: torch.device) -> Any:
    """A tensor on `device`; lists and dicts of tensors (a detection batch's per-image targets) item by item;
    anything else as it is."""
    if isinstance(value, Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, list):
        return [move(v, device) for v in value]
    if isinstance(value, dict):
        return {k: move(v, device) for k, v in value.items()}
    return value


def count_tokens(batch: dict[str, Any]) -> int:
    """Tokens the model processes (input plus decoder input; padding included): the throughput unit."""
    n = 0
    for key in ("input_ids", "decoder_input_ids"):
        t = batch.get(key)
        if isinstance(t, Tensor):
            n += t.numel()
    if n == 0:  # a non-token front end (pixels, audio): count examples
        first = next((v for v in batch.values() if isinstance(v, Tensor)), None)
        n = int(first.shape[0]) if first is not None and first.dim() else 0
    return n


def batch_rows(batch: dict[str, Any]) -> int:
    first = next((v for v in batch.values() if isinstance(v, Tensor) and v.dim()), None)
    return int(first.shape[0]) if first is not None else 1


def loss_and_count(out: Any, batch: dict[str, Any]) -> tuple[Tensor, Any]:
    """(mean loss, targets it averages) from a forward's return: an object with .loss (ModelOutput, Hugging
    Face outputs), a mapping with "loss", or the scalar loss itself. Without n_targets the batch's rows
    weigh it (exact for sequence-level losses)."""
    if isinstance(out, Tensor):
        loss, n = (out, None) if out.ndim == 0 else (None, None)
    elif isinstance(out, Mapping):
        loss, n = out.get("loss"), out.get("n_targets")
    else:
        loss, n = getattr(out, "loss", None), getattr(out, "n_targets", None)
    if loss is None:
        got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"the model's forward returned {got} without a loss: it must return a scalar loss, "
                         "a mapping with 'loss' or an object with .loss (does the batch have labels?)")
    return loss, n if n is not None else batch_rows(batch)
