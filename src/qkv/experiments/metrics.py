"""Reading a run's metrics.jsonl: the logged series, the steps to reach a threshold, the final training
loss, and whether the run diverged."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file (a truncated last line from a killed process is ignored)."""
    rows = []
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def metric_series(rows: list[dict[str, Any]], name: str) -> list[tuple[int, float]]:
    """(step, value) pairs of metric `name` in the trainer's log; eval metrics may carry an eval_/val_
    prefix."""
    keys = ["loss"] if name == "train_loss" else [name, f"eval_{name}", f"val_{name}", f"eval/{name}"]
    out = []
    for r in rows:
        for k in keys:
            if k in r and isinstance(r[k], (int, float)) and "step" in r:
                out.append((int(r["step"]), float(r[k])))
                break
    return out


def steps_to_threshold(series: list[tuple[int, float]], threshold: float | None, goal: str) -> int | None:
    """First logged step whose value is at least as good as the threshold (None: never, or no threshold)."""
    if threshold is None:
        return None
    for step, v in series:
        if math.isfinite(v) and (v <= threshold if goal == "min" else v >= threshold):
            return step
    return None


def final_train_loss(rows: list[dict[str, Any]], tail: float = 0.1) -> float:
    """Mean of the last `tail` fraction (at least one) of the logged training losses; NaN if any is
    non-finite."""
    return final_logged(rows, "loss", tail)


def final_logged(rows: list[dict[str, Any]], key: str, tail: float = 0.1) -> float:
    """Mean of the last `tail` fraction (at least one) of the values logged under `key`; NaN if there are
    none or any of them is non-finite."""
    losses = [r[key] for r in rows if key in r and isinstance(r[key], (int, float))]
    if not losses:
        return float("nan")
    k = max(1, int(round(len(losses) * tail)))
    last = losses[-k:]
    return float("nan") if not all(math.isfinite(x) for x in last) else sum(last) / len(last)


def is_diverged(rows: list[dict[str, Any]], error: str | None) -> bool:
    """Diverged: the trainer stopped on a non-finite value, a non-finite loss was logged, or the final
    loss is above the first logged loss (training made the model worse than its initialisation)."""
    if error:
        return True
    losses = [r["loss"] for r in rows if "loss" in r and isinstance(r["loss"], (int, float))]
    if not losses:
        return False
    if not all(math.isfinite(x) for x in losses):
        return True
    fin = final_train_loss(rows)
    return not math.isfinite(fin) or fin > losses[0]
