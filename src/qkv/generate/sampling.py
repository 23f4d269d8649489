"""The sampling filters and the draw of one decoding step (the WARPERS of processors.py call them).

The order follows Hugging Face's sampling pipeline: temperature, then top-k, then top-p (nucleus),
then a draw from softmax of what is left. Every filter sets removed logits to -inf and never renormalises
by hand (softmax does that), so the filters compose.
"""

from __future__ import annotations

import torch
from torch import Tensor


def top_k_filter(logits: Tensor, k: int | None) -> Tensor:
    """Keep the k largest logits of each row (ties with the k-th value are kept too); -inf elsewhere.
    k None, 0 or >= vocab leaves the logits unchanged."""
    if k is None or k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1) the k-th largest value
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float | None) -> Tensor:
    """Nucleus filtering (Holtzman et al. 2020): keep the smallest set of most likely tokens whose total
    probability is >= p; the most likely token is always kept. p None or >= 1 leaves the logits unchanged."""
    if p is None or p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    # probability mass strictly before each token: the token is needed while that mass is still < p
    before = torch.cumsum(probs, dim=-1) - probs
    remove_sorted = before >= p
    remove_sorted[..., 0] = False
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def sample(logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw per row from softmax(logits): (B, V) -> (B,) token ids."""
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
