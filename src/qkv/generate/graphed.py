"""Graph-captured decoding: the decoding step compiled once with torch.compile over the static KV cache.

With GenerationConfig(compile=True) (or generate(..., compile=True)) the prompt is prefilled eagerly (its
length varies) and every further token goes through `model.static_step` (models/base.py, nn/stack.py): one
token per row, its K/V written at a device-side column index, attention over every column of the
preallocated cache with the future masked. No shape depends on the position and nothing is read back to the
host, so torch.compile traces one graph for the whole generation, and mode="reduce-overhead" replays it as a
CUDA graph: one launch per step instead of one per kernel, which is what a small model at batch 1 is bound by
on a GPU. On a CPU the step is bound by the one-row weight products: there Inductor writes them as fused
reductions and calls its kernels from C++ (cpu_options; docs/performance.md has what that gains).

compile=True means backend="inductor" (mode="reduce-overhead" on a GPU); a string names another
torch.compile backend ("eager", "aot_eager": tracing without code generation, which the tests use). The
compiled step is kept per model and backend, so later generate() calls reuse it (a new batch size or cache
length compiles again).

Inductor keeps the code it generates on disk, under $QKV_CACHE/inductor (default ~/.cache/qkv/inductor; an
explicit TORCHINDUCTOR_CACHE_DIR wins): a second process that compiles the same model and shapes traces again
but reuses the compiled kernels, so it starts in seconds rather than the first compile's minutes.
"""

from __future__ import annotations

import os
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

_COMPILED: weakref.WeakKeyDictionary[Any, dict[str, Callable[..., Tensor]]] = weakref.WeakKeyDictionary()
# per model: the static caches of graph-captured generations, one per (batch, length, dtype, device), reused
# by later calls so that a CUDA graph recorded over their buffers is replayed, not recorded again
_CACHES: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()
# per cache: the other static buffers of its steps (the column index, the key mask, the left padding)
_BUFFERS: weakref.WeakKeyDictionary[Any, dict[str, Tensor]] = weakref.WeakKeyDictionary()


def _step(model: Any, ids: Tensor, cache: Any, index: Tensor, n_pad: Tensor | None,
          keep: Tensor | None) -> Tensor:
    offset = index if n_pad is None else index - n_pad  # each row's position: its first real token is 0
    return model.static_step(ids, cache, index=index, offset=offset, keep=keep)


BUCKET = 256  # cache lengths are rounded up to a multiple of this under compile


def cache_bucket(n_positions: int, context: int | None) -> int:
    """The cache length for `n_positions` under compile: rounded up to a multiple of BUCKET (capped at the
    model's context), so that generations of different lengths share one compiled graph (its shapes are
    the cache's)."""
    size = -(-n_positions // BUCKET) * BUCKET
    return size if context is None else max(n_positions, min(size, context))


def static_cache(model: Any, batch_size: int, max_len: int, owner: object) -> Any:
    """model.make_cache(batch_size, max_len), kept and reset for the next generation of the same shape (the
    memory stays allocated while the model lives; `release(model)` frees it). `owner` (the generation) is
    recorded on it: two interleaved generations of one shape (two stream() iterators) would share the buffers,
    so the older one's next step finds another owner and stops with an error (check_owner)."""
    p = next(model.parameters())
    key = (batch_size, max_len, p.dtype, p.device)
    caches = _CACHES.setdefault(model, {})
    cache = caches.get(key)
    if cache is None:
        cache = caches[key] = model.make_cache(batch_size, max_len)
    # a position table (RoPE's) grown here, eagerly: growing it inside the captured step would replace a
    # buffer that a recorded CUDA graph reads
    position = getattr(getattr(model, "decoder", None), "position", None)
    if position is not None:
        position.reserve(max_len)
    cache.reset()
    cache.owner = owner
    return cache


def check_owner(cache: Any, owner: object) -> None:
    if getattr(cache, "owner", None) is not owner:
        raise RuntimeError("compile: another generation with compile=True of the same model and shape reused "
                           "this generation's static cache (interleaved stream() calls); finish one first, "
                           "or use compile=False for the other")


def release(model: Any) -> None:
    """Drop the model's kept caches and compiled steps."""
    _CACHES.pop(model, None)
    _COMPILED.pop(model, None)


def _buffer(cache: Any, name: str, like: Tensor) -> Tensor:
    """The cache's persistent buffer `name`, shaped and typed like `like`, holding like's values."""
    bufs = _BUFFERS.setdefault(cache, {})
    buf = bufs.get(name)
    if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
        buf = bufs[name] = torch.empty_like(like)
        torch._dynamo.mark_static_address(buf)
    return buf.copy_(like)


def check_graphable(model: Any) -> None:
    """A clear error for a model without the static decoding step (the LSTM) or with a position bias."""
    if not callable(getattr(model, "static_step", None)):
        raise ValueError(f"compile: {type(model).__name__} has no static decoding step (graph-captured "
                         f"decoding needs a Transformer decoder over a static KV cache); use compile=False")
    if not model.static_step_supported:
        raise ValueError("compile: graph-captured decoding does not support ALiBi or relative-bias positions "
                         "(their bias depends on the query position); use compile=False")


def inductor_cache_dir() -> Path:
    """Where Inductor keeps its compiled code: TORCHINDUCTOR_CACHE_DIR if set, else $QKV_CACHE/inductor
    (default ~/.cache/qkv/inductor), set in the environment for this process (Inductor reads it there)."""
    # Inductor takes seconds to import: only a compiled generation pays for it
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # noqa: PLC0415

    # torch writes its own default into the variable the first time it looks: that value is not a user's
    # choice
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        root = Path(os.environ.get("QKV_CACHE", Path.home() / ".cache" / "qkv"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def _own_step() -> Callable[..., Tensor]:
    """`_step` with a code object of its own. Dynamo keeps its compiled graphs, and counts recompilations
    against torch._dynamo.config.recompile_limit (8), per code object: through one shared `_step`, the ninth
    model (or shape) compiled in a process failed with fullgraph=True ("recompile limit exceeded"). Per model,
    the limit counts that model's own shapes."""
    return types.FunctionType(_step.__code__.replace(), _step.__globals__, _step.__name__)


def cpu_options() -> dict[str, Any]:
    """Inductor's settings for the compiled step on a CPU (torch.compile's `options`, which it takes instead
    of a `mode`). decompose_mm_pass: Inductor rewrites each one-row weight product (batch 1; both sides at
    most 2048, so not the output head) into a multiply and a row sum that it fuses and vectorises, instead of
    calling torch's one-row GEMM. cpp_wrapper: the graph calls its kernels from generated C++ rather than a
    Python wrapper, one Python call per kernel saved, hundreds a step. Together 1.05-1.2x the speed of the
    step under Inductor's defaults, paired in three runs of benchmarks/compiled_decode.py
    (docs/performance.md)."""
    return {"post_grad_fusion_options": {"decompose_mm_pass": {}}, "cpp_wrapper": True}


def compiled_step(model: Any, compile: bool | str) -> Callable[..., Tensor]:
    """The compiled `_step` for `model` (kept per model and backend). Weights stay graph inputs (no freezing),
    so a weight changed in place after compiling is read as it is now. Inductor on a CUDA device:
    mode="reduce-overhead" (CUDA graphs); on a CPU: cpu_options()."""
    backend = "inductor" if compile is True else str(compile)
    if backend == "inductor":
        inductor_cache_dir()
    per_model = _COMPILED.setdefault(model, {})
    fn = per_model.get(backend)
    if fn is None:
        settings: dict[str, Any] = {}
        if backend == "inductor":
            on_cpu = next(model.parameters()).device.type == "cpu"
            settings = {"options": cpu_options()} if on_cpu else {"mode": "reduce-overhead"}
        fn = per_model[backend] = torch.compile(_own_step(), backend=backend, fullgraph=True, dynamic=False,
                                                **settings)
    return fn


class GraphedSteps:
    """The decoding steps of one generation through the compiled step. `keep`: the (B, >= cached) key mask of
    the generation (None: no padding), read once here: the columns after the prompt are all real tokens.
    The device-side column index (advanced in place after each step, never read back), the mask and the
    padding are copied into buffers kept with the cache, and they and the cache are marked as static
    addresses: a CUDA graph uses them in place, and a later generation over the same kept cache
    (static_cache) replays the graph instead of recording a new one."""

    def __init__(self, model: Any, compile: bool | str, cache: Any, n_pad: Tensor | None,
                 keep: Tensor | None) -> None:
        if keep is not None:
            # the mask over the cache's columns (of a longer buffer its first max_len; a shorter one is padded
            # with True: columns that only generated tokens ever fill)
            full = torch.ones(keep.shape[0], cache.max_len, dtype=torch.bool, device=keep.device)
            n = min(keep.shape[1], cache.max_len)
            full[:, :n] = keep[:, :n]
            keep = _buffer(cache, "keep", full)
        if n_pad is not None:
            n_pad = _buffer(cache, "n_pad", n_pad)
        self.model, self.cache, self.n_pad, self.keep = model, cache, n_pad, keep
        self.fn = compiled_step(model, compile)
        self.index = _buffer(cache, "index",
                             torch.full((1,), cache.length, dtype=torch.long, device=cache.buffers[0].device))
        for buffer in cache.buffers:
            torch._dynamo.mark_static_address(buffer)
        self.cuda = cache.buffers[0].is_cuda

    def __call__(self, ids: Tensor) -> Tensor:
        """Next-token logits (B, V) after ids (B, 1); advances the cache by one."""
        if self.cuda:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs may be overwritten now
        # ids is a column of the generation's token buffer, whose row stride is the generation's length:
        # passed as is, every generation of another length would fail the compiled graph's stride guard and
        # compile again (and past torch._dynamo's cache limit fall back to eager). A kept buffer has one
        # layout.
        ids = _buffer(self.cache, "ids", ids)
        logits = self.fn(self.model, ids, self.cache, self.index, self.n_pad, self.keep)
        self.cache.advance(1)
        self.index.add_(1)
        return logits.clone() if self.cuda else logits  # a CUDA graph's output lives in its memory pool
