"""Shared by the benchmark scripts (run as `python benchmarks/NAME.py`, so this folder is on sys.path)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def interleaved(fns: dict[str, Callable[[], Any]],
                repeats: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Time every function once per round, the same order each round (A B C, A B C, ...), so that a machine
    whose speed drifts slows all of them alike. Returns (seconds per function, one per round; each function's
    last result)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    last: dict[str, Any] = {}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            last[k] = fn()
            times[k].append(time.perf_counter() - t0)
    return times, last


def write_results(out: str | Path, stem: str, result: dict, lines: list[str]) -> None:
    """OUT/STEM.json (the result) and OUT/STEM.md (the table lines), and the table on stdout."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
