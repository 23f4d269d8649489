"""nn.Linear with faster CPU paths: the same parameters, state-dict keys and function, y = x W^T + b.
Training and prefill can go through oneDNN (below); a decoding step goes through pre-transposed weights
(`Linear.step`).

Why oneDNN: PyTorch's CPU `addmm`/`mm` call MKL's sgemm. On AMD CPUs with full-width AVX-512 MKL takes a
slower code path, while oneDNN, also bundled with every x86 PyTorch build, JIT-compiles for the CPU it runs
on: there a (2048 x 384) @ (384 x 1536) fp32 product ran ~2x faster through oneDNN and a GPT training step
1.59x faster (docs/perf/train_vs_hf.md, docs/performance.md). On an AVX2-only AMD EPYC the same A/B gave no
gain beyond the noise (training step 1.03x, docs/perf/onednn_linear.md), so the default ("auto") takes
oneDNN only where the CPU reports AVX-512.

The backend is one process-wide setting (`set_linear_backend` / the `linear_backend` context manager, or
the environment: QKV_LINEAR_BACKEND=auto|onednn|aten; QKV_ONEDNN=0 means aten):
  "auto"    oneDNN on CPUs with AVX-512 where this torch build has the op, else aten (the default)
  "onednn"  oneDNN wherever it applies (an error if this build lacks it)
  "aten"    always F.linear
Even under "onednn" the oneDNN path is taken only where it is semantically identical and not a loss:
  fp32 CPU tensors, at least MIN_ROWS rows (oneDNN's per-call overhead loses on the few rows of a decoding
  step), no autocast (autocast must still turn F.linear into a bf16 matmul), not under torch.compile
  (Inductor picks its own kernels), plain tensors (not DTensor / tensor subclasses).
Everything else goes through F.linear. Results differ from F.linear only by fp32 summation order (~1e-6
relative).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

BACKENDS = ("auto", "onednn", "aten")
# Linear.step on CPU in fp32: a narrowing product (in_features > out_features: the FFN's down projection) keeps
# the (out, in) layout; measured on AVX2 (docs/perf/decode_floor.md) its dot-product kernel reads W faster than
# the transposed copy's. False: every layer through the transposed copy, as before (benchmarks/decode_floor.py --ab).
STEP_NARROW_DIRECT = True
MIN_ROWS = 64  # below this, MKL's lower call overhead wins (measured: docs/perf/train_vs_hf.md)
# Linear.step on CPU in fp32 with at least this many rows (a batched decoding step) multiplies by a copy of the
# weight packed by oneDNN for small-row products instead of the transposed copy. MKL's sgemm at 2-16 rows runs
# far from the memory-bandwidth bound on the AVX2 EPYC (8 rows x (576 x 1536): 0.62 ms through W^T vs 0.41 ms
# packed; the (49152 x 576) output head 49 ms vs 12 ms; docs/llm.md, benchmarks/step_rows.py). One row keeps
# the transposed copy (its matrix-vector kernel is faster there). 0: never (every step as before).
STEP_PACKED_MIN_ROWS = 2
# A single-row fp32 CPU step multiplies projections of the same input (a gated FFN's gate and up) by one joined
# transposed copy (joint_step): one matrix-vector product instead of two. False: each Linear.step alone, as before
# (the A/B control of benchmarks/decode_floor.py --ab).
JOINT_STEP = True
# bf16 products of at least this many rows (a batched decoding step, a prefill) on a CPU without native bf16 (no
# AVX512-BF16/AMX: oneDNN has no bf16 kernel there and torch falls back to a generic loop that reads the weight once
# per row): the weight is upcast to fp32 one tile of BF16_TILE_ELEMS elements at a time into a small reused buffer,
# multiplied there by the fp32 BLAS and the result rounded to bf16 once (`bf16_tiled_linear`). The weight stays
# bf16 (no fp32 copy is kept); the products of bf16 numbers are exact in fp32 and the sums are fp32 in both routes,
# so the result equals F.linear's up to fp32 summation order (a bf16 rounding flip, 1 ulp, now and then). Measured
# on the AVX2 EPYC (docs/perf/bf16_12d.md): the layers of a 135M Llama at 32 rows 941 -> 150 ms (1 thread), at
# 2 threads on a quiet machine 377 -> 189 ms at 32 rows, 180 -> 139 at 16, but 107 -> 112 at 8 and 51 -> 69 at 4;
# in a whole batch-8 decoding step (2 threads, quiet) the tiles' upcasts made the step 146 -> 186 ms, so the
# threshold is 32 rows: prefills and large batched steps take the tiles, small batches keep torch's bf16 kernel.
# One row stays with F.linear (its bf16 matrix-vector kernel is as fast as the upcast alone). 0: never (every
# bf16 product through F.linear, as before).
BF16_TILE_MIN_ROWS = 32
BF16_TILE_ELEMS = 1 << 18  # 1 MB of fp32 per tile: the buffer stays in the cache while the rows are multiplied
# A bf16 decoding step of STEP_FP16_MIN_ROWS to BF16_TILE_MIN_ROWS - 1 rows (a batched step) on a CPU without native
# bf16 multiplies by an fp16 copy of the weight packed for fbgemm's fp16 GEMM (`Linear._fp16_packed`,
# torch.ops.quantized.linear_dynamic_fp16: F16C hardware conversion, fp32 multiply-adds) instead of torch's bf16
# kernel, which converts bf16 -> fp32 in software (~7 GB/s of weights per core on the AVX2 EPYC) and costs about one
# row-time per row (docs/perf/bf16_12e.md). The copy is scaled by a power of two 2^e (and the input by 2^-e) so that
# every bf16 weight is an fp16 number exactly (`fp16_pack` checks; a weight spanning more than 2^32 keeps F.linear):
# the products x_k w_k are exact in fp32 in both routes and both sum in fp32, so the result equals F.linear's up to
# fp32 summation order (a 1-ulp bf16 rounding flip now and then). Costs one more copy of the weight (2 bytes per
# weight, built at the first step like the fp32 path's transposed copies; `free_packed` drops it). Needs fbgemm (x86
# builds). False: F.linear as before.
STEP_BF16_VIA_FP16 = True
# ... for products of at least this many rows: ONE row (batch-1 decoding) keeps torch's bf16 matrix-vector kernel,
# which spreads the rows over both cores; on the quiet EPYC the 135M Llama's batch-1 step took 76.8 ms through the
# fp16 copy (its layers on one thread) and 64.0 ms without it (84.7 / 81.6 / 68.1 ms with the fp16 layers on one
# thread / on two / off, docs/perf/stop24/); batch 8 gains ~2.7x.
STEP_FP16_MIN_ROWS = 2
# ... and for ONE row when the weight has at least this many elements (the output head of a large vocabulary): the
# 135M Llama's 49152 x 576 head took 3.4 ms through the fp16 copy vs 4.4-6.0 ms through torch's bf16 kernel (2
# threads, AVX2 EPYC), and a whole batch-1 step 0.9-1.6 ms less (paired A/B, docs/perf/bf16_12g.md); the layers'
# one-row products stay with torch's kernel (no gain there, bf16_12f.md). Costs the head's fp16 copy (2 bytes a
# weight) while decoding. 0: one row always keeps torch's kernel.
STEP_FP16_ONE_ROW_MIN_WEIGHT = 1 << 22
# A gated FFN's gate and up in a bf16 step of STEP_FP16_MIN_ROWS to BF16_TILE_MIN_ROWS - 1 rows (a batch; the same
# conditions as the fp16 copy) multiply by ONE joined fp16 copy of both weights (`joint_step`) instead of one copy
# each: the same bytes, one product fewer per layer; whole steps of the 135M Llama 1.9 / 4.0 / 4.5 ms faster at batch
# 2 / 8 / 16 (paired A/B, docs/perf/bf16_12g.md). One row keeps torch's kernel for both: there the joined fp16
# product made the step 1.5-2.1 ms slower. False: each projection its own copy, as before.
JOINT_STEP_BF16 = True
# ... for weights of at least this many elements: the route's three ops (x in fp32, the product, the rounding) cost
# ~10 us more than F.linear's one, more than the faster kernel saves on a small layer (a 64-wide model's products
# went 0.3-0.7x in benchmarks/bf16_routes.py --quick); the 135M Llama's smallest product has 331,776.
STEP_FP16_MIN_WEIGHT = 1 << 16


# Training (and evaluation) under torch.autocast("cpu", dtype=torch.bfloat16) on a CPU without native bf16: autocast
# turns every linear into a bf16 matmul, which such a CPU emulates (a BERT-base layer's forward + backward ~50 s
# against ~0.5 s in fp32, docs/perf/beam14d_finetune_bf16.md). With this on, qkv's Linear of at least
# BF16_TILE_MIN_ROWS rows and the fused attention compute the same bf16 products with the fp32 BLAS instead:
# operands rounded to bf16, fp32 sums, outputs and gradients rounded to bf16 (`_Bf16AutocastLinear`,
# attention.bf16_autocast_sdpa): bf16 mixed precision's numerics at about fp32 speed (docs/perf/ft14e.md).
# False: autocast's own kernels, as before.
BF16_AUTOCAST_FP32 = True


def _backend_from_env() -> str:
    name = os.environ.get("QKV_LINEAR_BACKEND", "").strip().lower()
    if name in BACKENDS:
        return name
    return "aten" if os.environ.get("QKV_ONEDNN") == "0" else "auto"


_BACKEND = _backend_from_env()


def _probe() -> bool:
    """Is the oneDNN fp32 inner product usable in this torch build?"""
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        # fixed values, not torch.randn: probing must not consume the global RNG (bit-exact resume)
        x = torch.linspace(-1, 1, 12).view(4, 3)
        w, b = torch.linspace(-2, 1, 6).view(2, 3), torch.tensor([0.5, -0.25])
        return torch.allclose(op(x, w, b, "none", [], ""), F.linear(x, w, b), atol=1e-5)
    except Exception:  # pragma: no cover - builds without the op or without oneDNN fp32 support
        return False


_AVAILABLE: bool | None = None


def onednn_available() -> bool:
    """Does this torch build have a working oneDNN fp32 inner product? (probed once)"""
    global _AVAILABLE
    if _AVAILABLE is None:
        _AVAILABLE = _probe()
    return _AVAILABLE


def get_linear_backend() -> str:
    """The current backend setting: "auto", "onednn" or "aten" (see the module docstring)."""
    return _BACKEND


def set_linear_backend(name: str) -> str:
    """Choose how qkv's Linear layers compute fp32 CPU products for the whole process: "auto" (oneDNN on
    AVX-512 CPUs, else aten), "onednn" (oneDNN wherever it applies) or "aten" (always F.linear). Returns
    the previous setting. The function computed is the same in all three (up to fp32 summation order)."""
    global _BACKEND
    if name not in BACKENDS:
        raise ValueError(f"linear backend {name!r} is not one of {', '.join(BACKENDS)}")
    if name == "onednn" and not onednn_available():
        raise ValueError("linear backend 'onednn': this torch build has no oneDNN fp32 inner product")
    old, _BACKEND = _BACKEND, name
    return old


@contextlib.contextmanager
def linear_backend(name: str) -> Iterator[None]:
    """`with linear_backend("aten"): ...` sets the backend for the block and restores the previous one
    (process-wide, like set_linear_backend: not thread-local)."""
    old = set_linear_backend(name)
    try:
        yield
    finally:
        set_linear_backend(old)


def _onednn_on() -> bool:
    if _BACKEND == "aten":
        return False
    if _BACKEND == "auto" and not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    return onednn_available()


def _mm(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """x @ w^T + b through oneDNN; x (..., in), w (out, in)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _mm(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        g2 = grad.reshape(-1, grad.shape[-1])  # (N, out)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _mm(grad, weight.t().contiguous())  # (..., out) @ (out, in): weight^T is (in, out)
        if ctx.needs_input_grad[1]:
            gw = _mm(g2.t(), x.reshape(-1, x.shape[-1]).t())  # (out, N) @ (N, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


def use_onednn(x: Tensor, weight: Tensor) -> bool:
    """Does `linear(x, weight)` take the oneDNN path under the current backend?"""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if x.numel() < MIN_ROWS * x.shape[-1] or type(x) is not Tensor or type(weight) not in (Tensor, nn.Parameter):
        return False
    if torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling():
        return False
    return _onednn_on()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, through oneDNN where the backend setting says so (see the module docstring), or, for bf16 inference
    on several rows on a CPU without native bf16, through fp32 tiles of the weight (`use_bf16_tiles`)."""
    if use_onednn(x, weight):
        return _OneDNNLinear.apply(x.contiguous(), weight, bias)
    if x.dtype == torch.bfloat16 and use_bf16_tiles(x, weight):
        return bf16_tiled_linear(x, weight, bias)
    if use_bf16_autocast_fp32(x, weight):
        return _Bf16AutocastLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


_NATIVE_BF16: bool | None = None


def native_bf16() -> bool:
    """Does this CPU multiply bf16 natively (oneDNN's bf16 kernels: AVX512-BF16 or AMX)? (probed once)"""
    global _NATIVE_BF16
    if _NATIVE_BF16 is None:
        try:
            _NATIVE_BF16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except Exception:  # pragma: no cover - builds without the op: assume the fast path is native
            _NATIVE_BF16 = True
    return _NATIVE_BF16


def use_bf16_tiles(x: Tensor, weight: Tensor) -> bool:
    """Does a bf16 product x @ weight^T take `bf16_tiled_linear`? Inference only (no autograd: the tiles have no
    backward; training keeps F.linear), CPU, bf16 input and weight, at least BF16_TILE_MIN_ROWS rows, no autocast, not
    under torch.compile, plain tensors, and a CPU without native bf16 (see BF16_TILE_MIN_ROWS)."""
    if not BF16_TILE_MIN_ROWS or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or not x.is_cpu:
        return False
    if x.numel() < BF16_TILE_MIN_ROWS * x.shape[-1] or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return False
    if type(x) is not Tensor or type(weight) not in (Tensor, nn.Parameter) or torch.compiler.is_compiling():
        return False
    return not native_bf16()


def bf16_tiled_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias) for bf16 tensors, computed in fp32 one tile of the weight's rows at a time: each tile
    is upcast into one reused fp32 buffer (BF16_TILE_ELEMS elements), multiplied by the fp32 rows of x, the bias added
    in fp32, and the (rows, out) fp32 result rounded to bf16 once at the end. No copy of the weight outlives the
    call. x (..., in), weight (out, in) -> (..., out) bf16."""
    n_out, n_in = weight.shape
    x2 = x.reshape(-1, n_in).float()
    y = torch.empty(x2.shape[0], n_out, dtype=torch.float32)
    step = max(1, min(n_out, BF16_TILE_ELEMS // n_in))
    buf = torch.empty(step, n_in, dtype=torch.float32)
    b = None if bias is None else bias.float()
    for s in range(0, n_out, step):
        n = min(step, n_out - s)
        tile = buf[:n].copy_(weight[s:s + n])
        y[:, s:s + n] = torch.mm(x2, tile.t()) if b is None else torch.addmm(b[s:s + n], x2, tile.t())
    return y.to(torch.bfloat16).view(*x.shape[:-1], n_out)


_FP16_PACKABLE: bool | None = None


def fp16_packable() -> bool:
    """Can this torch build pack a weight for fbgemm's fp16 GEMM (torch.ops.quantized.linear_prepack_fp16)?"""
    global _FP16_PACKABLE
    if _FP16_PACKABLE is None:
        try:
            x, w = torch.linspace(-1, 1, 12).view(4, 3), torch.linspace(-2, 1, 6).view(2, 3)
            y = torch.ops.quantized.linear_dynamic_fp16(x, torch.ops.quantized.linear_prepack_fp16(w, None))
            _FP16_PACKABLE = bool(torch.allclose(y, F.linear(x, w), atol=1e-3))
        except Exception:  # builds without fbgemm (non-x86)
            _FP16_PACKABLE = False
    return _FP16_PACKABLE


def use_fp16_step(x: Tensor, weight: Tensor) -> bool:
    """Does a bf16 decoding step x @ weight^T go through the fp16 copy (see STEP_BF16_VIA_FP16)? CPU, bf16 input and
    weight of at least STEP_FP16_MIN_WEIGHT elements, at least STEP_FP16_MIN_ROWS rows (or one row and a weight of at
    least STEP_FP16_ONE_ROW_MIN_WEIGHT) and fewer than BF16_TILE_MIN_ROWS rows (more take the tiles; the caller
    checks), and `fp16_step_applies`."""
    if not STEP_BF16_VIA_FP16 or weight.numel() < STEP_FP16_MIN_WEIGHT:  # the size tests first: they cost least
        return False
    if x.numel() < STEP_FP16_MIN_ROWS * x.shape[-1] and not (
            STEP_FP16_ONE_ROW_MIN_WEIGHT and weight.numel() >= STEP_FP16_ONE_ROW_MIN_WEIGHT):
        return False
    return fp16_step_applies(x, weight)


def fp16_step_applies(x: Tensor, weight: Tensor) -> bool:
    """The conditions of the fp16 copy beyond sizes: bf16 input and weight on the CPU, no autograd, no autocast, not
    under torch.compile, plain tensors, and a CPU without native bf16 whose torch has fbgemm."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or not x.is_cpu:
        return False
    if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling():
        return False
    if type(x) is not Tensor or type(weight) not in (Tensor, nn.Parameter):
        return False
    return not native_bf16() and fp16_packable()


def fp16_pack(weight: Tensor, bias: Tensor | None) -> tuple[object, Tensor] | tuple[None, None]:
    """(fbgemm's packed fp16 copy of weight * 2^e, 2^-e as a 1-element fp32 tensor) for `use_fp16_step`: e puts the
    largest |weight| in [2^14, 2^15), inside fp16's range, so that every bf16 weight from 2^-32 of the largest up is
    an fp16 number exactly (see STEP_BF16_VIA_FP16); the bias is kept in fp32, unscaled (the input is scaled by 2^-e
    instead). (None, None) where some nonzero weight is smaller than that (it would not be exact in fp16: a matrix
    whose weights span more than 2^32): such a layer keeps F.linear."""
    top = weight.detach().abs().amax().item()
    e = 14 - math.floor(math.log2(top)) if top > 0 and math.isfinite(top) else 0
    # a bf16 number (8 significant bits) times 2^e is an fp16 number when it is >= 2^-17 (fp16's subnormals are
    # multiples of 2^-24) and <= 65504 (the choice of e)
    nonzero = weight.detach().abs().masked_fill(weight.detach() == 0, float("inf"))
    if nonzero.amin().item() * 2.0 ** e < 2.0 ** -17:
        return None, None
    # rounded to fp16 here, as one chain: no fp32 copy held on
    w16 = weight.detach().float().mul_(2.0 ** e).half().float()
    b = None if bias is None else bias.detach().float()
    return torch.ops.quantized.linear_prepack_fp16(w16, b), torch.tensor([2.0 ** -e])


# -- bf16 autocast (training) on a CPU without native bf16: the fp32 BLAS on bf16-rounded operands --------------
def use_bf16_autocast_fp32(x: Tensor, weight: Tensor | None = None) -> bool:
    """Does a product with input x (linear's x, attention's q) take the fp32 route of bf16 autocast
    (`_Bf16AutocastLinear`, and `bf16_autocast_sdpa` in nn/attention.py)? BF16_AUTOCAST_FP32 on, CPU autocast to
    bf16 on, a CPU without native bf16, at least BF16_TILE_MIN_ROWS rows, not under torch.compile, plain tensors
    (x and the weight, if given). Grad mode does not matter (an evaluation under autocast takes it too)."""
    if not BF16_AUTOCAST_FP32 or not x.is_cpu or not torch.is_autocast_enabled("cpu"):
        return False
    if torch.get_autocast_dtype("cpu") != torch.bfloat16 or x.numel() < max(1, BF16_TILE_MIN_ROWS) * x.shape[-1]:
        return False
    if type(x) not in (Tensor, nn.Parameter) or torch.compiler.is_compiling():
        return False
    if weight is not None and type(weight) not in (Tensor, nn.Parameter):
        return False
    return not native_bf16()


def _bf16(t: Tensor) -> Tensor:
    return t.to(torch.bfloat16)


class _Bf16AutocastLinear(torch.autograd.Function):
    """F.linear under CPU bf16 autocast, with autocast's numerics and the fp32 BLAS's speed: x, weight and bias are
    rounded to bf16 (what autocast casts them to), multiplied in fp32 (products of bf16 numbers are exact in fp32;
    the sums are fp32 in both) and the output rounded to bf16 once. The backward likewise: the (bf16) output
    gradient times the bf16-rounded weight / input in fp32, each gradient rounded to bf16 (autocast's addmm
    backward returns bf16) and handed back in its input's dtype (autocast's cast backward: fp32 for fp32 master
    weights). Saved for backward: the bf16 input (as autocast's addmm saves it) and the weight itself (a
    parameter: no copy), rounded again in the backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        xb = _bf16(x)
        ctx.save_for_backward(xb, weight)
        ctx.dtypes = (x.dtype, None if bias is None else bias.dtype)
        x2 = xb.reshape(-1, xb.shape[-1]).float()
        # the whole weight rounded in one fp32 copy (not bf16_tiled_linear's tiles: a training step holds the fp32
        # weight anyway, and one product avoids the tiles' strided writes)
        wt = _bf16(weight).float().t()
        with torch.autocast("cpu", enabled=False):  # the fp32 products below must stay fp32
            y = torch.mm(x2, wt) if bias is None else torch.addmm(_bf16(bias).float(), x2, wt)
        return _bf16(y).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        xb, weight = ctx.saved_tensors
        x_dtype, b_dtype = ctx.dtypes
        g = grad.reshape(-1, grad.shape[-1]).float()  # (N, out); bf16 values (autocast's output dtype)
        gx = gw = gb = None
        with torch.autocast("cpu", enabled=False):
            if ctx.needs_input_grad[0]:
                gx = _bf16(g @ _bf16(weight).float()).to(x_dtype).view(xb.shape)
            if ctx.needs_input_grad[1]:
                gw = _bf16(g.t() @ xb.reshape(-1, xb.shape[-1]).float()).to(weight.dtype)
            if b_dtype is not None and ctx.needs_input_grad[2]:
                gb = _bf16(g.sum(0)).to(b_dtype)
        return gx, gw, gb


# -- the decoding path: weights pre-transposed once -----------------------------------------------------
def free_packed(module: nn.Module) -> int:
    """Drop the decoding copies of every Linear in `module` (pre-transposed, oneDNN-packed, the bf16 step's fp16),
    and the joined copies of `joint_step` (to free their memory, or after changing weights through `.data`); they
    are rebuilt at the next decoding step. Returns how many."""
    n = 0
    for m in module.modules():
        if isinstance(m, Linear):
            had = m.__dict__.pop("_decode_copy", None) is not None
            had |= bool(m.__dict__.pop("_decode_onednn", None))
            had |= bool(m.__dict__.pop("_decode_fp16", None))
            n += had
        n += m.__dict__.pop("_decode_joined", None) is not None  # joint_step's copies (e.g. an FFN's gate + up)
        n += bool(m.__dict__.pop("_decode_joined_fp16", None))
    return n


_PACKABLE: bool | None = None


def onednn_packable() -> bool:
    """Can this torch build pack an fp32 weight for oneDNN's inner product (Linear.step's batched path)?"""
    global _PACKABLE
    if _PACKABLE is None:
        ok = onednn_available() and hasattr(getattr(torch.ops, "mkldnn", None), "_reorder_linear_weight")
        if ok:
            try:
                x, w = torch.linspace(-1, 1, 12).view(4, 3), torch.linspace(-2, 1, 6).view(2, 3)
                wp = torch.ops.mkldnn._reorder_linear_weight(w, 4)
                ok = torch.allclose(torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [], ""), F.linear(x, w),
                                    atol=1e-5)
            except Exception:  # pragma: no cover - builds without the op
                ok = False
        _PACKABLE = ok
    return _PACKABLE


class _Transient(dict):
    """Holds a decode-time oneDNN copy (an opaque tensor, which neither deepcopy nor pickle can read): copies
    and pickles of the module carry an empty holder, and the copy is rebuilt at the next step."""

    def __deepcopy__(self, memo: dict) -> _Transient:
        return _Transient()

    def __reduce__(self) -> tuple:
        return (_Transient, ())


class Linear(nn.Linear):
    """Drop-in nn.Linear (same parameters and state-dict keys) using `linear` above, plus `step`, the
    decoding path.

    `step(x)` computes the same function for the few rows of a decoding step (inference, no autograd). On
    CPU it multiplies by a copy of the weight stored transposed, (in, out) contiguous: `addmm(b, x, W^T)`
    then runs the matrix-vector kernel that reads W along its rows, ~25% faster than x @ W^T on this
    project's CPUs (Hugging Face's GPT-2 Conv1D stores its weights that way). The copy is built at the first
    step and rebuilt whenever the weight changes (`_packed`); it costs the memory of the weight once more
    (`free_packed` drops it). A step of STEP_PACKED_MIN_ROWS rows or more (a batch) multiplies instead by a
    copy packed by oneDNN (`_onednn_packed`, same bytes, made at the first such step): a process that decodes
    both single rows and batches holds both copies, twice the weight on top of it (`free_packed` drops both).
    A bf16 step on a CPU without native bf16 multiplies by an fp16 copy through fbgemm instead (`_fp16_packed`,
    STEP_BF16_VIA_FP16; half the weight's fp32 bytes). On accelerators `step` is F.linear (cuBLAS reads either
    layout at full speed)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

    def packed(self, scale_first: tuple[int, float] | None = None) -> tuple[Tensor, Tensor | None]:
        """(W^T (in, out) contiguous, bias), detached; rebuilt when the weight or bias changed since they were
        made. scale_first=(n, s) multiplies the first n outputs by s inside the copy (free at run time:
        attention folds its 1/sqrt(d_k) into the query columns)."""
        packed = self._packed(scale_first)
        return packed[1], packed[2]

    def _packed(self, scale_first: tuple[int, float] | None) -> tuple:
        """(key, W^T, bias). "Changed" is read from the storage address, the dtype and PyTorch's version
        counter (`Tensor._version`, bumped by every in-place operation: optimizer steps, `copy_` in
        load_state_dict, `mul_` under no_grad). This is the only place qkv reads the counter. Writes through
        `.data` bypass it: after such a write call `free_packed(model)`. Parameters are read from
        `_parameters` directly: nn.Module.__getattr__ costs about a microsecond, and this runs for every
        linear of every decoding step."""
        params = self._parameters
        w, b = params["weight"], params["bias"]
        key = (*_changed_key(self), scale_first)
        packed = self.__dict__.get("_decode_copy")
        if packed is None or packed[0] != key:
            # a normal tensor even when the first step runs under torch.inference_mode
            with torch.inference_mode(False), torch.no_grad():
                wt = w.detach().t().contiguous()
                bias = None if b is None else b.detach().clone()
                if scale_first is not None:
                    n, s = scale_first
                    wt[:, :n] *= s
                    if bias is not None:
                        bias[:n] *= s
            packed = self.__dict__["_decode_copy"] = (key, wt, bias)
        return packed

    def _onednn_packed(self, scale_first: tuple[int, float] | None) -> tuple:
        """(key, W packed by oneDNN for few-row products, bias): the batched step's copy, the same bytes as the
        weight, made and refreshed like `_packed`'s (the same key)."""
        params = self._parameters
        w, b = params["weight"], params["bias"]
        key = (*_changed_key(self), scale_first)
        holder = self.__dict__.get("_decode_onednn")
        packed = None if holder is None else holder.get("copy")
        if packed is None or packed[0] != key:
            with torch.inference_mode(False), torch.no_grad():
                wd = w.detach()
                bias = None if b is None else b.detach().clone()
                if scale_first is not None:
                    n, s = scale_first
                    wd = wd.clone()
                    wd[:n] *= s
                    if bias is not None:
                        bias[:n] *= s
                wp = torch.ops.mkldnn._reorder_linear_weight(wd.contiguous(), 8)
            packed = (key, wp, bias)
            self.__dict__["_decode_onednn"] = _Transient(copy=packed)
        return packed

    def _fp16_packed(self) -> tuple:
        """(key, fbgemm's fp16 copy, input scale) for a bf16 step (`use_fp16_step`, `fp16_pack`), made and refreshed
        like `_packed`'s copy (the same key)."""
        params = self._parameters
        w, b = params["weight"], params["bias"]
        key = _changed_key(self)
        holder = self.__dict__.get("_decode_fp16")
        packed = None if holder is None else holder.get("copy")
        if packed is None or packed[0] != key:
            with torch.inference_mode(False), torch.no_grad():
                packed = (key, *fp16_pack(w, b))
            self.__dict__["_decode_fp16"] = _Transient(copy=packed)
        return packed

    def packed_weight(self) -> Tensor:
        """W^T (in, out), contiguous, detached (see packed)."""
        return self._packed(None)[1]

    def step(self, x: Tensor, scale_first: tuple[int, float] | None = None) -> Tensor:
        """x (..., in) -> (..., out) for inference on a few rows (a decoding step); scale_first=(n, s)
        returns the first n outputs multiplied by s."""
        params = self._parameters  # not nn.Module.__getattr__ (~1 us a lookup): 151 calls a step of a 30-layer model
        weight, bias = params["weight"], params["bias"]
        bf16 = x.dtype == torch.bfloat16
        tiles = bf16 and use_bf16_tiles(x, weight)  # a batch's rows, bf16, no native bf16
        packed = None
        if bf16 and not tiles and use_fp16_step(x, weight):
            _, packed, inv = self._fp16_packed()  # packed None: a weight fp16 cannot hold exactly (fp16_pack)
        if packed is not None:
            x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
            # x * 2^-e in fp32 in one op (a 1-element fp32 tensor promotes the product to fp32); exact
            y = torch.ops.quantized.linear_dynamic_fp16(x2 * inv, packed).to(torch.bfloat16)
            y = y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
            return y if scale_first is None else _scale_first(y, scale_first)
        if tiles or not x.is_cpu or x.dtype != torch.float32 or torch.compiler.is_compiling():
            # under torch.compile the data-pointer lookup of the transposed copy cannot be traced;
            # accelerators read either layout at full speed; on CPU the transposed copy is a win in fp32 only:
            # a bf16 (1 x 576) @ (576 x 1536) product took 2.1 ms through it vs 0.27 ms through F.linear
            # (oneDNN's bf16 kernel wants the (out, in) layout; benchmarks/llm.py)
            y = (bf16_tiled_linear if tiles else F.linear)(x, weight, bias)
            return y if scale_first is None else _scale_first(y, scale_first)
        rows = x.numel() // self.in_features
        if STEP_PACKED_MIN_ROWS and rows >= STEP_PACKED_MIN_ROWS and onednn_packable() \
                and not torch.is_autocast_enabled("cpu"):
            _, wp, b = self._onednn_packed(scale_first)
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), wp, b, "none", [], "")
        if scale_first is None and STEP_NARROW_DIRECT and self.in_features > self.out_features:
            return F.linear(x, weight, bias)  # narrowing: the original layout, no transposed copy
        if x.dim() != 2:
            return self.step(x.reshape(-1, x.shape[-1]), scale_first).view(*x.shape[:-1], self.out_features)
        _, wt, b = self._packed(scale_first)
        return torch.addmm(b, x, wt) if b is not None else torch.mm(x, wt)


def _scale_first(y: Tensor, scale_first: tuple[int, float]) -> Tensor:
    """y with its first n outputs multiplied by s in place, scale_first = (n, s): two ops (a view and mul_) where
    `y[..., :n] *= s` dispatches four (it also copies the view onto itself)."""
    y.narrow(-1, 0, scale_first[0]).mul_(scale_first[1])
    return y


def _changed_key(lin: Linear) -> tuple:
    """What tells a decode-time copy of lin's weight and bias that they changed (see Linear._packed): the weight's
    storage address, version counter and dtype, and the bias's version counter."""
    w, b = lin._parameters["weight"], lin._parameters["bias"]
    return (w.data_ptr(), w._version, w.dtype, -1 if b is None else b._version)


def _joined(linears: tuple[Linear, ...]) -> tuple[Tensor, Tensor | None]:
    """The linears' weights stacked along the outputs (sum of outs, in), detached, and their biases likewise (zeros
    for a linear without one; None when none has one)."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    if all(lin.bias is None for lin in linears):
        return weight, None
    return weight, torch.cat([lin.bias.detach() if lin.bias is not None else weight.new_zeros(lin.out_features)
                              for lin in linears])


def joint_step(owner: nn.Module, x: Tensor, linears: tuple[Linear, ...]) -> Tensor | None:
    """[l.step(x) for l in linears] concatenated along the last dimension, as ONE product, for a single-row fp32
    CPU decoding step (several projections of the same input: a gated FFN's gate and up), or a bf16 step of a batch's
    few rows on a CPU without native bf16 (`_joint_fp16_step`, JOINT_STEP_BF16). x: (rows, in). Returns None
    where that does not apply (another shape, dtype or device, autograd, torch.compile); the caller then calls
    each Linear.step. The joined transposed copy (in, sum of outs) lives on `owner` and is rebuilt when any of
    the weights or biases changed (the same test as Linear._packed); the linears' own transposed copies are then
    never built, so it costs no memory beyond what their separate copies did (`free_packed` drops it). One
    matrix-vector product instead of k saves k - 1 calls (and k - 1 wake-ups of the BLAS threads) per layer of
    every step; the bytes read are the same. The results are the separate products' (the same dot products,
    placed side by side) up to the kernel's blocking (~1e-7 relative). A subclass with its own step (an
    unmerged LoRA adapter adds its update there: qkv.finetune.lora) is never joined: None."""
    if not JOINT_STEP or x.dim() != 2 or not x.is_cpu or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    if any(type(lin).step is not Linear.step for lin in linears):
        return None
    if x.dtype == torch.bfloat16:
        return _joint_fp16_step(owner, x, linears)
    if x.shape[0] != 1 or x.dtype != torch.float32:
        return None
    key = [_changed_key(lin) for lin in linears]
    joined = owner.__dict__.get("_decode_joined")
    if joined is None or joined[0] != key:
        if any(lin.weight.dtype != torch.float32 for lin in linears):
            return None
        with torch.inference_mode(False), torch.no_grad():
            weight, bias = _joined(linears)
            wt = weight.t().contiguous()
            del weight
        joined = owner.__dict__["_decode_joined"] = (key, wt, bias)
    _, wt, bias = joined
    return torch.addmm(bias, x, wt) if bias is not None else torch.mm(x, wt)


def _joint_fp16_step(owner: nn.Module, x: Tensor, linears: tuple[Linear, ...]) -> Tensor | None:
    """joint_step for a bf16 step of STEP_FP16_MIN_ROWS to BF16_TILE_MIN_ROWS - 1 rows (see JOINT_STEP_BF16): one product through
    ONE fbgemm fp16 copy of the linears' weights joined along the outputs (`fp16_pack`: exact, the input scaled by
    2^-e), on `owner`, rebuilt when a weight or bias changed. None where it does not apply: the caller then steps
    each Linear (which may take its own fp16 copy)."""
    rows = x.shape[0]
    if not (JOINT_STEP_BF16 and STEP_BF16_VIA_FP16) or rows < STEP_FP16_MIN_ROWS \
            or (BF16_TILE_MIN_ROWS and rows >= BF16_TILE_MIN_ROWS):
        return None
    weights = [lin._parameters["weight"] for lin in linears]
    if not fp16_step_applies(x, weights[0]) or any(w.dtype != torch.bfloat16 or type(w) is not type(weights[0])
                                                   for w in weights):
        return None
    if sum(w.numel() for w in weights) < STEP_FP16_MIN_WEIGHT:
        return None
    holder = owner.__dict__.get("_decode_joined_fp16")
    joined = None if holder is None else holder.get("copy")
    key = [_changed_key(lin) for lin in linears]
    if joined is None or joined[0] != key:
        with torch.inference_mode(False), torch.no_grad():
            weight, bias = _joined(linears)
            joined = (key, *fp16_pack(weight, bias))
            del weight
        owner.__dict__["_decode_joined_fp16"] = _Transient(copy=joined)
    _, packed, inv = joined
    if packed is None:  # weights fp16 cannot hold exactly
        return None
    return torch.ops.quantized.linear_dynamic_fp16(x * inv, packed).to(torch.bfloat16)
