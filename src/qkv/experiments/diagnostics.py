"""Attention health checks: heads whose softmax is near one-hot or near uniform, and q.k score statistics.

Seed 000, section 2.2: after changing the model width, check the distribution of the attention scores; a
softmax output close to one-hot usually means the scaling factor and the dimension do not match. This module
makes that check one call:

  head_stats(weights)   per head: mean largest probability and mean normalised entropy over the query rows
                        (rows that see a single key are skipped: their softmax is one-hot by construction)
  flag_heads(stats)     "one-hot" when mean max prob >= onehot_max_prob, "uniform" when entropy >=
                        uniform_entropy
  diagnose(model, ...)  runs the model once, returns per-head stats + flags (every attention kind) and the
                        per-layer statistics of the pre-softmax scores q.k * scale (+ bias), masked keys
                        excluded
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

import qkv.nn.attention as A
from qkv.experiments.attention import collect_attentions, visible_keys
from qkv.experiments.head_stats import (  # noqa: F401  (re-exported: the checks are one module to callers)
    ONEHOT_MAX_PROB,
    UNIFORM_ENTROPY,
    HeadStat,
    flag_heads,
    head_stats,
)


@dataclass
class ScoreStat:
    module: str  # e.g. "decoder.blocks.0.attn"
    mean: float
    std: float
    max_abs: float
    d_k: int
    scale: float


@dataclass
class Diagnosis:
    heads: list[HeadStat] = field(default_factory=list)
    scores: list[ScoreStat] = field(default_factory=list)

    @property
    def flagged(self) -> list[HeadStat]:
        return [h for h in self.heads if h.flag]

    def to_markdown(self) -> str:
        lines = ["| attention | layer | head | mean max p | entropy / log n | flag |",
                 "|---|---|---|---|---|---|"]
        for h in self.heads:
            lines.append(f"| {h.kind} | {h.layer} | {h.head} | {h.max_prob:.3f} | {h.entropy:.3f} | {h.flag} "
                         "|")
        lines += ["", "| module | d_k | scale | score mean | score std | max abs score |",
                  "|---|---|---|---|---|---|"]
        for s in self.scores:
            lines.append(f"| {s.module} | {s.d_k} | {s.scale:.4g} | {s.mean:.3f} | {s.std:.3f} | "
                         f"{s.max_abs:.2f} |")
        n = len(self.flagged)
        lines += ["", f"{n} of {len(self.heads)} heads flagged (one-hot: mean max p >= {ONEHOT_MAX_PROB}; "
                  f"uniform: entropy >= {UNIFORM_ENTROPY} of the maximum)."]
        return "\n".join(lines)


@contextlib.contextmanager
def record_scores(model: nn.Module) -> Iterator[list[ScoreStat]]:
    """Within the block, every MultiHeadAttention call of `model` appends the statistics of its pre-softmax
    scores (q.k * scale + bias, over the keys its mask lets it see) to the yielded list.

    It wraps qkv.nn.attention.scaled_dot_product_attention (the function MultiHeadAttention calls) and names
    each call after the module through forward pre-hooks; both are removed on exit."""
    stats: list[ScoreStat] = []
    current: list[str] = [""]
    original = A.scaled_dot_product_attention

    def wrapper(q: Tensor, k: Tensor, v: Tensor, **kw: Any):
        with torch.no_grad():
            H, Hkv = q.shape[1], k.shape[1]
            kk = k.repeat_interleave(H // Hkv, dim=1) if Hkv != H else k
            scale = kw.get("scale") or 1.0 / math.sqrt(q.shape[-1])
            s = (q @ kk.transpose(-2, -1)).double() * scale
            if kw.get("bias") is not None:
                s = s + kw["bias"]
            full = A._combined_mask(q.shape[2], kk.shape[2], kw.get("mask"),
                                    kw.get("causal", False), q.device)
            vals = s[full.expand_as(s)] if full is not None else s.reshape(-1)
            if vals.numel():
                stats.append(ScoreStat(current[0], vals.mean().item(),
                                       vals.std().item() if vals.numel() > 1 else 0.0,
                                       vals.abs().max().item(), q.shape[-1], float(scale)))
        return original(q, k, v, **kw)

    handles = []
    for name, m in model.named_modules():
        if isinstance(m, A.MultiHeadAttention):
            handles.append(m.register_forward_pre_hook(lambda mod, args, n=name: current.__setitem__(0, n)))
    A.scaled_dot_product_attention = wrapper
    try:
        yield stats
    finally:
        A.scaled_dot_product_attention = original
        for h in handles:
            h.remove()


def diagnose(model: nn.Module, inputs: dict[str, Tensor] | Tensor, *,
             onehot_max_prob: float = ONEHOT_MAX_PROB, uniform_entropy: float = UNIFORM_ENTROPY) -> Diagnosis:
    """Run `model` once on `inputs` (input ids (B, T) or a batch dict of forward kwargs; labels are dropped)
    and return per-head softmax stats with flags plus per-module q.k score statistics."""
    with record_scores(model) as scores:
        maps = collect_attentions(model, inputs)
    heads: list[HeadStat] = []
    for kind, layers in maps.items():
        vis = visible_keys(model, kind, inputs, layers[0].shape[-2], layers[0].shape[-1])
        for i, w in enumerate(layers):
            heads.extend(head_stats(w, kind, i, vis))
    flag_heads(heads, onehot_max_prob=onehot_max_prob, uniform_entropy=uniform_entropy)
    return Diagnosis(heads, list(scores))
