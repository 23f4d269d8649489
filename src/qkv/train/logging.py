"""Run logging (rank 0 only): metrics.jsonl, metrics.csv, diagnostics.jsonl, train.log, a tqdm bar,
TensorBoard event files when `tensorboard` is installed, and curves.png at the end.

metrics.jsonl holds one JSON object per logged step: step, loss, lr, grad_norm, tokens_per_s, ... and
eval metrics prefixed `eval/` on the steps where evaluation ran. The files are only ever appended to or cut
short, never rewritten: on resume (and after a NaN rollback) the records after the step training continues
from are cut off with one truncate (they are about to be re-logged), together with a last line a kill cut
in half, so a kill at any moment leaves a file that describes one consistent run up to some step.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from qkv.storage import atomic_write

FIRST_COLUMNS = ["step", "loss", "lr", "grad_norm", "tokens_per_s"]


def truncate_jsonl(path: Path, step: int) -> list[dict[str, Any]]:
    """Cut a JSONL log in place (one os.truncate, never a rewrite) before its first record with a step
    above `step`, or its first line that is not complete JSON (a write cut by a kill); returns the kept
    records. Records are appended in step order, so what stays is exactly the history up to `step`."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    kept, offset = [], 0
    while offset < len(data):
        end = data.find(b"\n", offset)
        if end < 0:
            break  # no newline: a partial last line
        line = data[offset:end].strip()
        if line:
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                break
            if not isinstance(record, dict) or int(record.get("step", 0)) > step:
                break
            kept.append(record)
        offset = end + 1
    if offset < len(data):
        os.truncate(path, offset)
    return kept


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf: keep them visible as strings
    return v


class RunLogger:
    def __init__(self, out_dir: str | Path, *, enabled: bool, progress: bool, tensorboard: bool,
                 total_steps: int, start_step: int = 0) -> None:
        self.enabled = enabled
        self.out = Path(out_dir)
        self.records: list[dict[str, Any]] = []
        self.bar = None
        self.tb = None
        self.metrics_path = self.out / "metrics.jsonl"
        self.diag_path = self.out / "diagnostics.jsonl"
        if not enabled:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        # keep history up to the resumed step; later lines belong to an abandoned future
        self.rewind(start_step)
        self._log_file = open(self.out / "train.log", "a" if start_step else "w", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415  (tensorboard: an optional extra)

                self.tb = SummaryWriter(str(self.out / "tensorboard"),
                                        purge_step=start_step + 1 if start_step else None)
            except ImportError:  # tensorboard not installed: the JSONL/CSV files remain
                self.tb = None
        if progress:
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True,
                            file=sys.stderr, disable=None)

    def rewind(self, step: int) -> None:
        """Cut metrics.jsonl and diagnostics.jsonl after the last record of `step` (0: empty them)."""
        if not self.enabled:
            return
        for path in (self.metrics_path, self.diag_path):
            kept = truncate_jsonl(path, step)
            if path == self.metrics_path:
                self.records = kept

    def info(self, msg: str) -> None:
        if not self.enabled:
            return
        stamp = time.strftime("%H:%M:%S")
        self._log_file.write(f"[{stamp}] {msg}\n")
        self._log_file.flush()
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {k: _json_safe(v) for k, v in record.items()}
        self.records.append(record)
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            step = int(record["step"])
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, step)

    def diag(self, step: int, norms: dict[str, float]) -> None:
        if not self.enabled:
            return
        with open(self.diag_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **{k: _json_safe(v) for k, v in norms.items()}}) + "\n")
        if self.tb is not None:
            for k, v in norms.items():
                if math.isfinite(v):
                    self.tb.add_scalar(f"diag/{k}", v, step)

    def progress(self, step: int, loss: float, lr: float, tok_s: float) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
            self.bar.refresh()

    def step_line(self, step: int, total: int, loss: float, lr: float, tok_s: float) -> None:
        """One line per logged step (train.log_every) on stdout and in train.log when no progress bar is drawn
        (--no-progress, or output to a file): a run sent to a file shows that it advances."""
        if not self.enabled or (self.bar is not None and not self.bar.disable):
            return
        msg = f"step {step}/{total}: loss {loss:.4f}, lr {lr:.2e}, {tok_s:,.0f} tokens/s"
        self._log_file.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
        self._log_file.flush()
        print(msg, flush=True)

    def close(self, plot: bool = True) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        write_csv(self.records, self.out / "metrics.csv")
        if plot and self.records:
            try:
                plot_curves(self.records, self.out / "curves.png")
            except Exception as e:  # a plot must never lose a finished run
                self.info(f"could not write curves.png: {type(e).__name__}: {e}")
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if not self._log_file.closed:
            self._log_file.close()


def write_csv(records: list[dict[str, Any]], path: str | Path) -> None:
    """One row per record; columns: the fixed first ones, then every other key in order of appearance."""
    cols = [c for c in FIRST_COLUMNS if any(c in r for r in records)]
    for r in records:
        for k in r:
            if k not in cols:
                cols.append(k)
    path = Path(path)

    def write(tmp: str) -> None:  # rebuilt at every close: written aside, renamed over
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            for r in records:
                w.writerow({k: r.get(k, "") for k in cols})

    atomic_write(path, write)


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def plot_curves(records: list[dict[str, Any]], path: str | Path) -> None:
    """Loss (train and eval), LR, pre-clip grad norm and other eval metrics against step."""
    import matplotlib  # noqa: PLC0415  (matplotlib: slow to import, only for plots)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    evals = sorted({k for r in records for k in r if k.startswith("eval/") and k != "eval/loss"})
    routing = [k for k in ("aux_loss", "moe_maxvio") if any(k in r for r in records)]  # MoE models only
    panels = ["loss", "lr", "grad_norm"] + routing + evals
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.2 * len(panels)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], panels):
        xs, ys = _series(records, key)
        ax.plot(xs, ys, lw=1, label="train" if key == "loss" else key)
        if key == "loss":
            ex, ey = _series(records, "eval/loss")
            if ex:
                ax.plot(ex, ey, "o-", ms=3, lw=1, label="eval")
            ax.legend(loc="upper right", fontsize=8)
            if ys and min(ys) > 0:
                ax.set_yscale("log")
        ax.set_ylabel(key, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    path = Path(path)
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)
