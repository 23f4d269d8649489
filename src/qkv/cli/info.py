"""`qkv info` and `qkv presets`: parameter tables by module."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn


def parameter_table(model: nn.Module, depth: int = 2) -> list[tuple[str, int]]:
    """Unique parameters grouped by module path truncated to `depth` components; numeric components
    (block indices) are folded so a 12-layer stack shows as one row `decoder.blocks.*`."""
    rows: OrderedDict[str, int] = OrderedDict()
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        parts = ["*" if part.isdigit() else part for part in name.split(".")[:-1]]
        key = ".".join(parts[: depth + (1 if "*" in parts[:depth] else 0)]) or name
        rows[key] = rows.get(key, 0) + p.numel()
    return list(rows.items())


def format_table(rows: list[tuple[str, int]]) -> str:
    total = sum(n for _, n in rows) or 1
    width = max([len(r[0]) for r in rows] + [6])
    lines = [f"{'module':<{width}}  {'params':>14}  {'share':>6}", "-" * (width + 24)]
    for name, n in rows:
        lines.append(f"{name:<{width}}  {n:>14,}  {100 * n / total:>5.1f}%")
    lines.append("-" * (width + 24))
    lines.append(f"{'total':<{width}}  {total:>14,}  100.0%")
    return "\n".join(lines)
