"""Counting parameters and finding tied ones: the one implementation every layer uses."""

from __future__ import annotations

from torch import nn


def count_parameters(module: nn.Module, trainable_only: bool = False) -> int:
    """Unique parameters (a tied weight, e.g. GPT's LM head = token embedding, counted once)."""
    seen: set[int] = set()
    total = 0
    for p in module.parameters():  # parameters() already yields a shared tensor once; the set is for clarity
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def tied_names(module: nn.Module) -> set[str]:
    """Names under which an already-listed parameter appears again (weight tying): a checkpoint stores a
    tied weight once, under its first name."""
    seen, tied = set(), set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.add(id(p))
    return tied
