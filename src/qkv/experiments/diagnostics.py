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

ONEHOT_MAX_PROB = 0.9  # mean largest probability at or above this: the head attends to one key
UNIFORM_ENTROPY = 0.95  # mean entropy / log(#visible keys) at or above this: the head averages everything


@dataclass
class HeadStat:
    kind: str  # "self", "encoder self", "decoder self", "cross"
    layer: int
    head: int
    max_prob: float  # mean over valid rows of the largest probability
    entropy: float  # mean over valid rows of entropy / log(number of visible keys), in [0, 1]
    entropy_nats: float  # mean row entropy in nats (what the attention-map titles show)
    flag: str = ""  # "", "one-hot" or "uniform"


def head_stats(weights: Tensor, kind: str = "self", layer: int = 0,
               visible: Tensor | None = None) -> list[HeadStat]:
    """weights: (B, H, Tq, Tk) softmax probabilities. visible: bool, broadcastable to weights, True where the
    query may see the key (causal and padding masks); None = every key. The mask must be given rather than
    read off zeros, because a saturated float32 softmax underflows to exact zeros on keys it could see.
    Rows with fewer than 2 visible keys are skipped (their softmax is one-hot by construction)."""
    if weights.dim() != 4:
        raise ValueError(f"attention weights must be (B, H, Tq, Tk), got shape {tuple(weights.shape)}")
    w = weights.detach().double()
    vis = (torch.ones_like(w, dtype=torch.bool) if visible is None
           else visible.to(w.device).bool().expand_as(w))
    visible = vis.sum(-1)  # (B, H, Tq)
    ent = -(w * w.clamp_min(1e-300).log()).sum(-1)  # (B, H, Tq), nats
    norm_ent = ent / visible.clamp_min(2).double().log()
    maxp = w.max(-1).values
    valid = visible >= 2
    out = []
    for h in range(w.shape[1]):
        v = valid[:, h]
        n = int(v.sum())
        if n == 0:
            out.append(HeadStat(kind, layer, h, float("nan"), float("nan"), float("nan")))
            continue
        out.append(HeadStat(kind, layer, h, maxp[:, h][v].mean().item(), norm_ent[:, h][v].mean().item(),
                            ent[:, h][v].mean().item()))
    return out


def flag_heads(stats: list[HeadStat], *, onehot_max_prob: float = ONEHOT_MAX_PROB,
               uniform_entropy: float = UNIFORM_ENTROPY) -> list[HeadStat]:
    """Set .flag on each stat (in place) and return the flagged ones."""
    flagged = []
    for s in stats:
        s.flag = ""
        if math.isnan(s.max_prob):
            continue
        if s.max_prob >= onehot_max_prob:
            s.flag = "one-hot"
        elif s.entropy >= uniform_entropy:
            s.flag = "uniform"
        if s.flag:
            flagged.append(s)
    return flagged


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
    import qkv.nn.attention as A

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
    from qkv.experiments.attention import collect_attentions, visible_keys

    with record_scores(model) as scores:
        maps = collect_attentions(model, inputs)
    heads: list[HeadStat] = []
    for kind, layers in maps.items():
        vis = visible_keys(model, kind, inputs, layers[0].shape[-2], layers[0].shape[-1])
        for i, w in enumerate(layers):
            heads.extend(head_stats(w, kind, i, vis))
    flag_heads(heads, onehot_max_prob=onehot_max_prob, uniform_entropy=uniform_entropy)
    return Diagnosis(heads, list(scores))
