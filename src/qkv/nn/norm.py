"""Normalisation layers. Every norm takes (x, keep=None): keep is a (B, T) bool mask of real tokens,
which only BatchNorm needs (its statistics must ignore padding); the others normalise each token alone."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

NORMS = ("layernorm", "rmsnorm", "batchnorm")
_frozen_stats = 0  # > 0 while activation checkpointing recomputes a forward pass


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
        return super().forward(x)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * g  (Zhang & Sennrich 2019): LayerNorm without centring or bias."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor, keep: Tensor | None = None) -> Tensor:
        w = self.weight
        if x.dtype == w.dtype and x.dtype in (torch.float32, torch.float64):
            return torch.rms_norm(x, (x.shape[-1],), w, self.eps)
        # bf16/fp16 (or mixed dtypes): the statistics and the scaling in fp32, rounded once at the end
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * w.float()).to(x.dtype)


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
