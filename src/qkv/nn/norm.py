"""Normalisation layers. Every norm takes (x, keep=None): keep is a (B, T) bool mask of real tokens,
which only BatchNorm needs (its statistics must ignore padding); the others normalise each token alone."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

NORMS = ("layernorm", "rmsnorm", "batchnorm")
# RMSNorm.step on one fp32 or bf16 CPU row: the mean square as one BLAS product (False: forward(), as before; the A/B
# control of benchmarks/decode_floor.py --ab)
STEP_DOT_NORM = True
STEP_DOT_NORM_BF16 = True  # the same for one bf16 row (False: forward(), as before; benchmarks/llm.py --ab-tiles)
_frozen_stats = 0  # > 0 while activation checkpointing recomputes a forward pass
# RMSNorm on CPU in fp32/fp64 with at least this many elements (a long prompt's rows, not a decoding step's): the
# formula of torch.rms_norm's CPU implementation (pow, mean, rsqrt, mul, mul by the weight; the same result bit
# for bit) with its output written into the x^2 temporary, so one (T, d) tensor is allocated instead of two.
# Large fresh tensors are what a long prefill pays for in page faults (docs/perf/pre15c.md). 0: always
# torch.rms_norm (benchmarks/prefill.py --ablate).
RMS_LEAN_MIN_NUMEL = 1 << 16


@contextmanager
def frozen_running_stats() -> Iterator[None]:
    """Inside, BatchNorm normalises with batch statistics as usual but does not update its running
    statistics: gradient checkpointing recomputes each forward during backward, which would otherwise
    apply the momentum update twice per step (see nn/stack.py)."""
    global _frozen_stats
    _frozen_stats += 1
    try:
        yield
    finally:
        _frozen_stats -= 1


class LayerNorm(nn.LayerNorm):
    def __init__(self, d: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__(d, eps=eps, bias=bias)

    def forward(self, x: Tensor, keep: Tensor | None = None) -> Tensor:
        # torch.layer_norm directly (what F.layer_norm calls), parameters from _parameters (not through
        # nn.Module.__getattr__): norms run 2-3 times per layer of every decoding step
        p = self._parameters
        return torch.layer_norm(x, self.normalized_shape, p["weight"], p["bias"], self.eps,
                                x.is_cuda and torch.backends.cudnn.enabled)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * g  (Zhang & Sennrich 2019): LayerNorm without centring or bias."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor, keep: Tensor | None = None) -> Tensor:
        w = self._parameters["weight"]  # not through nn.Module.__getattr__: 2 norms per layer of every step
        if x.dtype == w.dtype and x.dtype in (torch.float32, torch.float64):
            if RMS_LEAN_MIN_NUMEL and x.numel() >= RMS_LEAN_MIN_NUMEL and x.is_cpu and not torch.is_grad_enabled():
                y = x.pow(2)
                return torch.mul(x, y.mean(-1, keepdim=True).add_(self.eps).rsqrt_(), out=y).mul_(w)
            # the same formula as one call (torch >= 2.4): a fused kernel on CUDA; on the CPU (torch 2.13) the same
            # six elementwise ops as the written-out formula, bit for bit (docs/perf/pre15c.md)
            return torch.rms_norm(x, (x.shape[-1],), w, self.eps)
        xf = x.float()  # bf16/fp16 (or mixed dtypes): the statistics and the scaling in fp32, rounded once at the end
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * w.float()).to(x.dtype)

    def step(self, x: Tensor, keep: Tensor | None = None) -> Tensor:
        """forward() for the rows of a decoding step (Block.step). One fp32 (or bf16: below) row on the CPU (batch-1 decoding):
        mean(x^2) + eps as one BLAS product, addmm(eps, x, x^T, alpha=1/d), then rsqrt and two scalings: four
        kernels where torch.rms_norm's CPU composite dispatches ~20 (measured 10 vs 15.5 us a call, 1 thread, AVX2;
        61 norms a step in a 30-layer model). Equal to forward() up to the dot product's summation order (~1e-7)."""
        w = self._parameters["weight"]
        if not STEP_DOT_NORM or x.dim() != 2 or x.shape[0] != 1 or x.dtype != w.dtype \
                or x.dtype not in (torch.float32, torch.bfloat16) or not x.is_cpu or torch.is_grad_enabled() \
                or torch.compiler.is_compiling():
            return self.forward(x, keep)
        cell = self.__dict__.get("_eps_cell")  # (eps, eps as a (1, 1) tensor: addmm's input)
        if cell is None or cell[0] != self.eps:
            with torch.inference_mode(False):
                cell = self.__dict__["_eps_cell"] = (self.eps, torch.full((1, 1), self.eps))
        if x.dtype == torch.bfloat16:
            if not STEP_DOT_NORM_BF16:
                return self.forward(x, keep)
            # forward()'s bf16 formula (statistics and scaling in fp32, the bf16 gain promoted exactly, one rounding
            # at the end) with the mean square as the fp32 dot product: 6 kernels instead of 9 (30 vs 42 us a call,
            # 2 threads, AVX2; docs/perf/bf16_12d.md)
            xf = x.float()
            r = torch.addmm(cell[1], xf, xf.t(), alpha=1.0 / x.shape[1]).rsqrt_()
            return torch.mul(xf, r).mul_(w).to(torch.bfloat16)
        r = torch.addmm(cell[1], x, x.t(), alpha=1.0 / x.shape[1]).rsqrt_()
        return torch.mul(x, r).mul_(w)


class BatchNorm(nn.Module):
    """BatchNorm over the feature dimension of (B, T, C) token sequences, for the seeds' LayerNorm-vs-
    BatchNorm comparison. Training statistics are taken over the real tokens only (keep mask), so padding
    never leaks into the mean/variance; running statistics are used in eval mode. Note that, unlike
    LayerNorm, it couples the examples of a batch: outputs depend on the batch composition in training."""

    def __init__(self, d: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.register_buffer("running_mean", torch.zeros(d))
        self.register_buffer("running_var", torch.ones(d))

    def forward(self, x: Tensor, keep: Tensor | None = None) -> Tensor:
        if self.training:
            flat = x.reshape(-1, x.shape[-1]) if keep is None else x[keep.bool()]
            if flat.shape[0] < 2:
                raise ValueError("BatchNorm needs at least 2 real tokens in a training batch")
            mean = flat.mean(0)
            var = flat.var(0, unbiased=False)
            if not _frozen_stats:
                self._update_running(mean, var, flat.shape[0])
        else:
            mean, var = self.running_mean.to(x.dtype), self.running_var.to(x.dtype)
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias

    @torch.no_grad()
    def _update_running(self, mean: Tensor, var: Tensor, n: int) -> None:
        self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), self.momentum)
        unbiased = var.detach() * n / (n - 1)  # running variance is unbiased, as torch.nn.BatchNorm1d
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), self.momentum)


def build_norm(kind: str, d: int, eps: float = 1e-5, bias: bool = True) -> nn.Module:
    if kind == "layernorm":
        return LayerNorm(d, eps, bias)
    if kind == "rmsnorm":
        return RMSNorm(d, eps)
    if kind == "batchnorm":
        return BatchNorm(d, eps)
    raise ValueError(f"unknown norm {kind!r}; choose one of {NORMS}")
