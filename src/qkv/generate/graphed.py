"""Graph-captured decoding: the decoding step compiled once with torch.compile over the static KV cache.

With GenerationConfig(compile=True) (or generate(..., compile=True)) the prompt is prefilled eagerly (its
length varies) and every further token goes through `model.static_step` (models/base.py, nn/stack.py): one
token per row, its K/V written at a device-side column index, attention over every column of the
preallocated cache with the future masked. No shape depends on the position and nothing is read back to the
host, so torch.compile traces one graph for the whole generation, and mode="reduce-overhead" replays it as a
CUDA graph: one launch per step instead of one per kernel, which is what a small model at batch 1 is bound by
on a GPU. On the CPU the same code runs (Inductor, or any backend named), with nothing like CUDA graphs to gain.

compile=True means backend="inductor", mode="reduce-overhead"; a string names another torch.compile backend
("eager", "aot_eager": tracing without code generation, which the tests use). The compiled step is kept per
model and backend, so later generate() calls reuse it (a new batch size or cache length compiles again).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from qkv.nn.linear import free_packed

_COMPILED: weakref.WeakKeyDictionary[Any, dict[str, Callable[..., Tensor]]] = weakref.WeakKeyDictionary()


def _step(model: Any, ids: Tensor, cache: Any, index: Tensor, n_pad: Tensor | None, keep: Tensor | None) -> Tensor:
    offset = index if n_pad is None else index - n_pad  # each row's position: its first real token is 0
    return model.static_step(ids, cache, index=index, offset=offset, keep=keep)


BUCKET = 256  # cache lengths are rounded up to a multiple of this under compile


def cache_bucket(n_positions: int, context: int | None) -> int:
    """The cache length for `n_positions` under compile: rounded up to a multiple of BUCKET (capped at the
    model's context), so that generations of different lengths share one compiled graph (its shapes are
    the cache's)."""
    size = -(-n_positions // BUCKET) * BUCKET
    return size if context is None else max(n_positions, min(size, context))


def check_graphable(model: Any) -> None:
    """A clear error for a model without the static decoding step (the LSTM) or with a position bias."""
    if not callable(getattr(model, "static_step", None)):
        raise ValueError(f"compile: {type(model).__name__} has no static decoding step (graph-captured decoding "
                         f"needs a Transformer decoder over a static KV cache); use compile=False")
    if not model.static_step_supported:
        raise ValueError("compile: graph-captured decoding does not support ALiBi or relative-bias positions "
                         "(their bias depends on the query position); use compile=False")


def compiled_step(model: Any, compile: bool | str) -> Callable[..., Tensor]:
    """The compiled `_step` for `model` (kept per model and backend)."""
    backend = "inductor" if compile is True else str(compile)
    per_model = _COMPILED.setdefault(model, {})
    fn = per_model.get(backend)
    if fn is None:
        mode = "reduce-overhead" if backend == "inductor" else None  # CUDA graphs (a no-op on the CPU)
        fn = per_model[backend] = torch.compile(_step, backend=backend, mode=mode, fullgraph=True, dynamic=False)
    return fn


class GraphedSteps:
    """The decoding steps of one generation through the compiled step. `keep`: the (B, >= cached) key mask of
    the generation (None: no padding), read once here: the columns after the prompt are all real tokens. Holds the device-side column index
    (advanced in place after each step, never read back) and the static buffers, marked as such so that
    CUDA graphs use them in place instead of copying them in at every replay."""

    def __init__(self, model: Any, compile: bool | str, cache: Any, n_pad: Tensor | None, keep: Tensor | None) -> None:
        if keep is not None and keep.shape[1] != cache.max_len:
            # the mask over the cache's columns (a longer buffer: its first max_len; a shorter one: padded with
            # True, columns that only generated tokens ever fill)
            full = torch.ones(keep.shape[0], cache.max_len, dtype=torch.bool, device=keep.device)
            n = min(keep.shape[1], cache.max_len)
            full[:, :n] = keep[:, :n]
            keep = full
        self.model, self.cache, self.n_pad, self.keep = model, cache, n_pad, keep
        self.fn = compiled_step(model, compile)
        self.index = torch.full((1,), cache.length, dtype=torch.long, device=cache.k.device)
        for t in (cache.k, cache.v, self.index, n_pad, keep):
            if t is not None:
                torch._dynamo.mark_static_address(t)
        self.cuda = cache.k.is_cuda
        # Linear.step keeps a transposed fp32 copy of each CPU weight, found again by comparing data pointers,
        # which Dynamo cannot trace: on the CPU the copies are dropped before each compiled step and rebuilt
        # inside it (a CPU-only cost; accelerators and bf16 take F.linear and keep no copy)
        self.unpack = cache.k.device.type == "cpu" and cache.k.dtype == torch.float32

    def __call__(self, ids: Tensor) -> Tensor:
        """Next-token logits (B, V) after ids (B, 1); advances the cache by one."""
        if self.cuda:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs may be overwritten now
        if self.unpack:
            free_packed(self.model)
        logits = self.fn(self.model, ids, self.cache, self.index, self.n_pad, self.keep)
        self.cache.advance(1)
        self.index.add_(1)
        return logits.clone() if self.cuda else logits  # a CUDA graph's output lives in its memory pool
