"""The report of a suite: a CSV of every run, a markdown table per variant, and PNG plots.

summary.md (one row per variant): the swept values, the final metric as mean +- std over seeds (sample std,
n-1; a single seed shows no +-), the steps to reach the threshold (mean over the seeds that reached it, with
how many did), diverged k/n, extra evaluations, the suite's `logged` training-log keys (final value: mean of
the last 10% logged), parameters and wall time. Plots: loss curves per variant (each seed a line), the same
for each logged key, and the final metric against each swept value.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path
from typing import Any

from qkv.experiments.efficiency import add_ratios
from qkv.experiments.metrics import final_logged, read_metrics
from qkv.experiments.suite import Suite


def _mean_std(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def fmt_mean_std(xs: list[float], digits: int = 3) -> str:
    finite = [x for x in xs if x is not None and math.isfinite(x)]
    if not finite:
        return "nan"
    m, s = _mean_std(finite)
    txt = f"{m:.{digits}f}" + (f" ± {s:.{digits}f}" if len(finite) > 1 else "")
    if len(finite) < len(xs):
        txt += f" ({len(xs) - len(finite)} nan)"
    return txt


def group(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault(r["variant"], []).append(r)
    return groups


def summary_rows(suite: Suite, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per variant (file order), ready for the markdown table."""
    rows = []
    for variant, rs in group(results).items():
        row: dict[str, Any] = dict(rs[0].get("values", {}))
        row["variant"] = variant
        row["seeds"] = len(rs)
        if suite.kind == "efficiency":
            for key in ("step_ms", "speedup", "peak_mb", "memory_ratio", "tokens_per_s", "step_ms_isolated"):
                row[key] = fmt_mean_std([r.get(key, float("nan")) for r in rs], 3 if key != "peak_mb" else 1)
            rows.append(row)
            continue
        judged = "train_loss (judged)" if suite.judge == "train_loss" else suite.metric.name
        row[judged] = fmt_mean_std([r.get("metric", float("nan")) for r in rs])
        row["_mean"] = _mean_std([r.get("metric", float("nan")) for r in rs])[0]
        if suite.judge == "train_loss":
            row[f"held-out {suite.metric.name}"] = fmt_mean_std([r.get("held_out", float("nan")) for r in rs])
            if suite.metric.goal == "min":  # a loss: held-out minus train is the memorisation gap
                row["gap"] = fmt_mean_std([r.get("held_out", float("nan")) - r.get("metric", float("nan"))
                                           for r in rs])
        if suite.metric.threshold is not None:
            reached = [r["steps_to_threshold"] for r in rs if r.get("steps_to_threshold") is not None]
            mean = f"{statistics.fmean(reached):.0f}" if reached else "never"
            row[f"steps to {suite.metric.threshold:g}"] = f"{mean} ({len(reached)}/{len(rs)})"
        n_diverged = sum(bool(r.get("diverged")) for r in rs)
        row["diverged"] = f"{'yes' if n_diverged else 'no'} ({n_diverged}/{len(rs)})"
        for ev in suite.extra_evals:
            row[ev.name] = fmt_mean_std([r.get("extra", {}).get(ev.name, float("nan")) for r in rs])
        for key in suite.logged:
            row[f"final {key}"] = fmt_mean_std([r.get("logged", {}).get(key, float("nan")) for r in rs])
        if suite.metric.name != "train_loss" and suite.judge != "train_loss":
            row["final train loss"] = fmt_mean_std([r.get("final_loss", float("nan")) for r in rs])
        row["params"] = rs[0].get("params", "")
        steps = [r["steps"] for r in rs if isinstance(r.get("steps"), (int, float))]
        row["steps"] = (f"{statistics.fmean(steps):.0f}" if len(set(steps)) <= 1 else
                        f"{statistics.fmean(steps):.0f} ({min(steps)}-{max(steps)})") if steps else ""
        row["wall s"] = f"{statistics.fmean([r.get('wall_s', 0.0) for r in rs]):.1f}"
        if suite.budget_clock == "cpu":  # the clock the budget counted (training + evaluation CPU time)
            row["cpu s"] = f"{statistics.fmean([r.get('cpu_s', float('nan')) for r in rs]):.1f}"
        rows.append(row)
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no runs)"
    cols = ["variant"] + [c for c in rows[0] if not c.startswith("_") and c != "variant"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines)


def write_csv(results: list[dict[str, Any]], path: Path) -> Path:
    keys: list[str] = []
    flat = []
    for r in results:
        f = {"run_id": r.get("run_id"), "variant": r.get("variant"), "seed": r.get("seed")}
        f.update({f"value.{k}": v for k, v in r.get("values", {}).items()})
        for k, v in r.items():
            if k in ("values", "run_id", "variant", "seed"):
                continue
            if isinstance(v, dict):
                f.update({f"{k}.{kk}": vv for kk, vv in v.items()})
            else:
                f[k] = v
        flat.append(f)
        keys += [k for k in f if k not in keys]
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(flat)
    return path


def _plt():
    import matplotlib  # noqa: PLC0415  (matplotlib: slow to import, only for plots)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def plot_loss_curves(out: Path, results: list[dict[str, Any]], title: str, key: str = "loss") -> Path | None:
    """The logged `key` against step, a line per run coloured by variant: loss_curves.png (log scale) for the
    training loss, logged_<key>.png for another key of metrics.jsonl."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    any_line = False
    cmap = plt.get_cmap("tab10" if len(group(results)) <= 10 else "tab20")
    for ci, (variant, rs) in enumerate(group(results).items()):
        for j, r in enumerate(rs):
            rows = read_metrics(out / "runs" / r["run_id"] / "metrics.jsonl")
            pts = [(row["step"], row[key]) for row in rows if key in row and "step" in row
                   and isinstance(row[key], (int, float)) and math.isfinite(row[key])]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, color=cmap(ci % cmap.N), lw=1.2, alpha=0.85, label=variant if j == 0 else None)
            any_line = True
    if not any_line:
        plt.close(fig)
        return None
    if key == "loss":
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (log scale)" if key == "loss" else key)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / ("loss_curves.png" if key == "loss" else f"logged_{key.replace('/', '_')}.png")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_metric_vs(out: Path, suite: Suite, results: list[dict[str, Any]]) -> list[Path]:
    """For each swept key: the metric (mean +- std over seeds) against its values, one line per setting of
    the other swept keys."""
    plt = _plt()
    metric_key = "step_ms" if suite.kind == "efficiency" else "metric"
    label = ("step time (ms)" if suite.kind == "efficiency" else
             "train_loss" if suite.judge == "train_loss" else suite.metric.name)
    keys = list(results[0].get("values", {})) if results else []
    paths = []
    for key in keys:
        lines: dict[str, dict[str, list[float]]] = {}
        order: list[str] = []
        for r in results:
            vals = r.get("values", {})
            rest = ",".join(f"{k}={v}" for k, v in vals.items() if k != key) or suite.name
            x = str(vals.get(key))
            if x not in order:
                order.append(x)
            lines.setdefault(rest, {}).setdefault(x, []).append(r.get(metric_key, float("nan")))
        if len(order) < 2:
            continue
        fig, ax = plt.subplots(figsize=(6.5, 4.0))
        pos = {x: i for i, x in enumerate(order)}
        for rest, pts in lines.items():
            xs = [pos[x] for x in order if x in pts]
            ms = [_mean_std(pts[x])[0] for x in order if x in pts]
            ss = [_mean_std(pts[x])[1] for x in order if x in pts]
            ax.errorbar(xs, ms, yerr=ss, marker="o", capsize=3, label=rest)
        ax.set_xticks(range(len(order)))
        ax.set_xticklabels(order)
        ax.set_xlabel(key)
        ax.set_ylabel(label + " (mean ± std over seeds)")
        ax.set_title(f"{suite.name}: {label} vs {key}", fontsize=10)
        if len(lines) > 1:
            ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"metric_vs_{key.replace('.', '_')}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def write_report(suite: Suite, results: list[dict[str, Any]], out: str | Path,
                 expected: int | None = None) -> Path:
    """results.csv, summary.md, summary.json, loss_curves.png, metric_vs_*.png in `out`; returns summary.md.
    results: every finished run of the suite in `out` (not only those just run: `qkv ablate --only` rewrites
    the whole report). expected: the suite's number of runs; with fewer results, summary.md says how many."""
    out = Path(out)
    if suite.kind == "efficiency":
        add_ratios(results)
    for r in results:  # the logged keys' final values, read from each run's log (runs finished earlier too)
        if suite.logged and r.get("run_id"):
            rows = read_metrics(out / "runs" / r["run_id"] / "metrics.jsonl")
            r["logged"] = {key: final_logged(rows, key) for key in suite.logged}
    write_csv(results, out / "results.csv")
    rows = summary_rows(suite, results)
    (out / "summary.json").write_text(json.dumps(rows, indent=1, default=str) + "\n", encoding="utf-8")
    plots = []
    if results and suite.kind != "efficiency":
        p = plot_loss_curves(out, results, f"{suite.name}: training loss per variant")
        if p:
            plots.append(p)
        for key in suite.logged:
            p = plot_loss_curves(out, results, f"{suite.name}: {key} per variant", key=key)
            if p:
                plots.append(p)
    if results:
        plots += plot_metric_vs(out, suite, results)
    lines = [f"# Ablation suite `{suite.name}`", ""]
    if suite.claim:
        lines += [f"Claim: {suite.claim}" + (f" ({suite.source})" if suite.source else ""), ""]
    if suite.kind == "efficiency":
        lines += ["step_ms: median step time with the variants' steps interleaved in one process (robust to "
                  "a machine whose speed drifts); step_ms_isolated: median in the variant's own process. "
                  "peak_mb: that process's peak resident memory above its level before the first step (GPU: "
                  "peak allocated). speedup and memory_ratio are against the first variant.", ""]
    else:
        thr = f", threshold {suite.metric.threshold:g}" if suite.metric.threshold is not None else ""
        if suite.judge == "train_loss":
            lines += [f"Judged on the training curve (final train loss, lower is better{thr}); the held-out "
                      f"{suite.metric.name} is shown beside it with the gap (held-out minus train), since a "
                      f"model that memorises its corpus has a held-out loss that measures overfitting.", ""]
            thr = ""
        lines += [f"Metric: {suite.metric.name} ({'higher' if suite.metric.goal == 'max' else 'lower'} is "
                  f"better{thr}), mean ± std over seeds {suite.seeds}. Diverged: non-finite loss, a stop by "
                  f"the trainer's NaN policy, or a final loss above the first logged loss.", ""]
    if expected is not None and len(results) < expected:  # a partial table must not read as the whole suite
        lines += [f"Partial: {len(results)} of the suite's {expected} runs have finished in this folder "
                  "(`qkv ablate` again, without --only, runs the rest).", ""]
    lines += [markdown_table(rows), ""]
    errors = [r for r in results if r.get("error")]
    if errors:
        lines += ["Runs that stopped with an error:", ""]
        lines += [f"- `{r['run_id']}`: {r['error']}" for r in errors]
        lines.append("")
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
