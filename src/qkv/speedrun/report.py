"""DIR/report.md, the speedrun's report card (as nanochat's): the machine, every phase's settings, wall and
CPU time and figures, the loss curves (DIR/report/*.png), the evaluation table and sample chats."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import torch  # noqa: E402

from qkv.speedrun.state import PHASES  # noqa: E402
from qkv.storage import atomic_write, atomic_write_text  # noqa: E402


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}


def loss_curve(metrics: Path, png: Path, title: str) -> bool:
    """The training loss of a run's metrics.jsonl as a PNG; False when the log has no loss."""
    points = []
    if metrics.is_file():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec.get("loss"), int | float):
                points.append((rec["step"], rec["loss"]))
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot(*zip(*points, strict=True))
    ax.set(xlabel="step", ylabel="train loss (nats/token)", title=title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(png, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
    return True


def _f(x: Any, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _phase_table(state: dict[str, Any]) -> list[str]:
    lines = ["| phase | wall (s) | CPU (s) | figures |", "|---|---:|---:|---|"]
    for name in [p for p in PHASES if p in state["phases"]]:
        fig = state["phases"][name]
        shown = ", ".join(f"{k}={_f(v)}" for k, v in fig.items()
                          if k not in ("wall_s", "cpu_s", "sample") and not isinstance(v, dict | list))
        lines.append(f"| {name} | {fig.get('wall_s', 0):.0f} | {fig.get('cpu_s', 0):.0f} | {shown} |")
    return lines


def _eval_table(ev: dict[str, Any]) -> list[str]:
    qa, syn = ev["doc_qa"], ev["synthetic"]
    return [
        "| evaluation (held-out modules) | n | SFT model | base model | chance |",
        "|---|---:|---:|---:|---:|",
        f"| doc QA ROUGE-L F1 (base model: {qa.get('few_shot', 0)}-shot) | {qa['n']} | "
        f"{qa['sft']['rouge_l']:.3f} | {qa['base_few_shot']['rouge_l']:.3f} | |",
        f"| doc QA token F1 | {qa['n']} | {qa['sft']['token_f1']:.3f} | "
        f"{qa['base_few_shot']['token_f1']:.3f} | |",
        f"| generated function bodies that ast.parse accepts | {ev['code']['n']} | | "
        f"{ev['code']['parse_rate']:.3f} | |",
        f"| addition exact match | {syn['addition']['n']} | {syn['addition']['exact_match']:.3f} | | "
        f"{syn['addition']['chance']:.3f} |",
        f"| spelling exact match | {syn['spelling']['n']} | {syn['spelling']['exact_match']:.3f} | | ~0 |",
    ]


def write_report(out: Path, state: dict[str, Any], wall_total: float) -> Path:
    """DIR/report.md from the record and DIR/eval/results.json."""
    ev = json.loads((out / "eval" / "results.json").read_text(encoding="utf-8"))
    curves = [(name, f"report/{name}_loss.png") for name, run in (("pretrain", "base"), ("sft", "chat"))
              if loss_curve(out / run / "metrics.jsonl", out / "report" / f"{name}_loss.png", name)]
    p = state["profile"]
    m = machine()
    lines = [f"# qkv speedrun report card: profile `{p['name']}`", "",
             f"Machine: {m['platform']}, Python {m['python']}, torch {m['torch']}, {m['cpus']} CPUs "
             f"({m['torch_threads']} torch threads), device {m['device']}. Total wall time of the phases: "
             f"{wall_total / 60:.1f} min.", "", "## Phases", "", *_phase_table(state), "",
             "## Evaluation", "", *_eval_table(ev), ""]
    lines += [f"![{name} loss]({png})" for name, png in curves] + [""]
    lines += ["## Sample chats", ""]
    for s in ev["samples"]:
        lines += [f"> **user:** {s['user']}", ">", f"> **assistant:** {s['assistant']}", ""]
    lines += ["## Doc QA examples (held-out modules)", ""]
    for x in ev["doc_qa"]["examples"]:
        lines += [f"- {x['q']}", f"  - reference: {x['reference']}", f"  - SFT: {x['sft']}",
                  f"  - base (few-shot): {x['base']}"]
    sample = state["phases"].get("pretrain", {}).get("sample", "")
    lines += ["", "## A base-model sample", "", "```python", sample, "```", "",
              "## Settings", "", "```json", json.dumps(p, indent=1), "```", ""]
    path = out / "report.md"
    atomic_write_text("\n".join(lines), path)
    return path


__all__ = ["loss_curve", "machine", "write_report"]
