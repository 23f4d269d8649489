"""The numeric fact behind the 1/sqrt(d_k) factor, measured rather than asserted.

Vaswani et al. 2017 (footnote 4) and both seed articles: if the components of q and k are independent with
mean 0 and variance 1, then q.k = sum_i q_i k_i has mean 0 and variance d_k. Unscaled scores therefore have
a standard deviation of sqrt(d_k); softmax over such scores is close to one-hot and its Jacobian
(diag(p) - p p^T) is close to zero, so almost no gradient flows back through the attention weights.
Dividing by sqrt(d_k) brings the score variance back to 1 whatever d_k is.

`softmax_saturation(d_ks)` samples random q, k for each d_k and measures, with and without scaling:
  var_qk        the variance of the raw dot product q.k (the fact predicts d_k)
  var_scores    the variance of the scores actually fed to softmax
  max_prob      the mean over query rows of the largest softmax probability (1.0 = one-hot)
  entropy       the mean row entropy divided by log(T) (1.0 = uniform, 0.0 = one-hot)
  grad_norm     the mean Frobenius norm of the softmax Jacobian per row (0 = no gradient gets through)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class SaturationRow:
    d_k: int
    scaled: bool
    var_qk: float
    var_scores: float
    max_prob: float
    entropy: float
    grad_norm: float


def softmax_saturation(
    d_ks: tuple[int, ...] | list[int] = (16, 64, 256, 1024), *, n_queries: int = 512, n_keys: int = 64,
    seed: int = 0,
) -> list[SaturationRow]:
    """For each d_k: q (n_queries, d_k), k (n_keys, d_k) ~ N(0, 1), scores = q k^T (* 1/sqrt(d_k))."""
    if n_keys < 2 or n_queries < 2:
        raise ValueError("softmax_saturation needs at least 2 queries and 2 keys")
    g = torch.Generator().manual_seed(seed)
    rows = []
    for d in d_ks:
        if d < 1:
            raise ValueError(f"d_k must be positive, got {d}")
        q = torch.randn(n_queries, d, generator=g, dtype=torch.float64)
        k = torch.randn(n_keys, d, generator=g, dtype=torch.float64)
        raw = q @ k.T  # (n_queries, n_keys)
        for scaled in (False, True):
            s = raw / math.sqrt(d) if scaled else raw
            p = torch.softmax(s, dim=-1)
            ent = -(p * p.clamp_min(1e-300).log()).sum(-1) / math.log(n_keys)
            # Jacobian of softmax for one row: J = diag(p) - p p^T;
            # ||J||_F^2 = sum p^2 - 2 sum p^3 + (sum p^2)^2
            s2, s3 = (p**2).sum(-1), (p**3).sum(-1)
            jac = (s2 - 2 * s3 + s2**2).clamp_min(0).sqrt()
            rows.append(SaturationRow(
                d_k=d, scaled=scaled, var_qk=raw.var().item(), var_scores=s.var().item(),
                max_prob=p.max(-1).values.mean().item(), entropy=ent.mean().item(),
                grad_norm=jac.mean().item(),
            ))
    return rows


def saturation_table(rows: list[SaturationRow]) -> str:
    """A markdown table of `softmax_saturation` rows."""
    head = "| d_k | scaled | Var(q.k) | Var(scores) | mean max p | entropy / log T | softmax Jacobian norm |"
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        lines.append(f"| {r.d_k} | {'yes' if r.scaled else 'no'} | {r.var_qk:.1f} | {r.var_scores:.2f} | "
                     f"{r.max_prob:.3f} | {r.entropy:.3f} | {r.grad_norm:.4f} |")
    return "\n".join(lines)


def plot_saturation(rows: list[SaturationRow], path: str) -> str:
    """Two panels against d_k: Var(scores) and the mean largest softmax probability, scaled vs unscaled."""
    import matplotlib  # noqa: PLC0415  (matplotlib: slow to import, only for plots)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for scaled, style in ((False, "o-"), (True, "s--")):
        rs = [r for r in rows if r.scaled == scaled]
        label = "q.k / sqrt(d_k)" if scaled else "q.k (unscaled)"
        axes[0].plot([r.d_k for r in rs], [r.var_scores for r in rs], style, label=label)
        axes[1].plot([r.d_k for r in rs], [r.max_prob for r in rs], style, label=label)
    axes[0].set_xscale("log", base=2)
    axes[0].set_yscale("log", base=2)
    axes[0].set_title("variance of the softmax input", fontsize=9)
    axes[1].set_xscale("log", base=2)
    axes[1].set_title("mean largest softmax probability (1 = one-hot)", fontsize=9)
    for ax in axes:
        ax.set_xlabel("d_k")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


if __name__ == "__main__":  # pragma: no cover
    import sys

    rows = softmax_saturation()
    print(saturation_table(rows))
    if len(sys.argv) > 1:
        print(plot_saturation(rows, sys.argv[1]))
