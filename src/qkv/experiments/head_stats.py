"""Per-head softmax statistics of attention maps (mean largest probability, mean normalised entropy) and
the one-hot / uniform flags: what experiments.attention reports per head and experiments.diagnostics checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

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
