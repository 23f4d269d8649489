"""Input checks shared by every layer: token ids and sequence lengths, with one clear error each.

They live at the bottom (nn/) so that models, generation, tasks and the serving engine all call the same
function, and nothing has to import a layer above it to validate its input.

Reading the range of a tensor (ids.min(), ids.max()) into Python is a device-to-host synchronisation on an
accelerator, and under torch.compile a graph break. A model's forward therefore checks the range only where
that is free: CPU tensors in eager mode. Everywhere else the ids are checked once where they enter the
library (generate(), Engine.add_request, the tokenizers, the tasks' batches) with `entry=True`; an id that
slips past those still fails inside the embedding (an index error), never silently.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_token_ids(ids: Tensor, vocab_size: int, what: str = "input_ids", *, entry: bool = False) -> None:
    """A clear error instead of an index error deep inside torch.nn.functional.embedding.

    The dtype is always checked (free). The range [0, vocab_size) is checked when it costs no device sync
    (a CPU tensor, not under torch.compile), or always with entry=True (the one check where ids enter)."""
    if ids.dtype not in (torch.int64, torch.int32):  # what nn.Embedding accepts as indices
        raise TypeError(f"{what} must be an integer tensor (int64 or int32), got {ids.dtype}; use .long()")
    if not ids.numel():
        return
    if not entry and (ids.device.type != "cpu" or torch.compiler.is_compiling()):
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = hi if hi >= vocab_size else lo
        raise ValueError(f"{what} contains token id {bad}, outside the vocabulary [0, {vocab_size})")


def check_batch(ids: Tensor, what: str = "input_ids") -> None:
    """ids must be a (batch, length) tensor: a clear error for one unbatched sequence (an IndexError on
    shape[1] otherwise) or an extra dimension."""
    if ids.dim() != 2:
        hint = f"; for one sequence pass {what}.unsqueeze(0)" if ids.dim() == 1 else ""
        raise ValueError(f"{what} must be (batch, length), got shape {tuple(ids.shape)}{hint}")


def check_labels(labels: Tensor, ids: Tensor, what: str = "input_ids") -> None:
    """Per-token labels must have the shape of the tokens they label (cross-entropy's error after flattening
    names row counts instead)."""
    if labels.shape != ids.shape:
        raise ValueError(f"labels must have the shape of {what} {tuple(ids.shape)}, got "
                         f"{tuple(labels.shape)}")


def check_id_list(ids: list[int], vocab_size: int, what: str = "prompt") -> None:
    """check_token_ids for a Python list (a request of the serving engine)."""
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{what} contains token id {bad}, outside the vocabulary [0, {vocab_size})")


def check_length(length: int, context: int | None, what: str = "sequence") -> None:
    """`length` positions must fit a context of `context` (None: no hard limit, e.g. RoPE or ALiBi)."""
    if context is not None and length > context:
        raise ValueError(f"{what} of length {length} exceeds the model's context of {context} positions")
