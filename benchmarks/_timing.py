"""Shared by the benchmark scripts (run as `python benchmarks/NAME.py`, so this folder is on sys.path)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
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
