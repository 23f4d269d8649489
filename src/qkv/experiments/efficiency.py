"""Efficiency runs (suite kind: efficiency): step time and peak memory of a few training steps.

Each variant runs in a fresh process (multiprocessing 'spawn'), so its peak resident memory (ru_maxrss) is
its own: peak_mb = peak RSS minus the RSS just before the first step (model, optimizer object and one batch
already built), i.e. gradients + optimizer state + activations of the step. Step time is the median over
the timed steps after untimed warm-up steps. The switches come from the variant's overrides:
  train.grad_checkpointing   recompute each block in backward
  train.precision            fp32 | bf16 (torch.autocast, CPU or CUDA)
  model.attention            naive | fused (torch SDPA)
On a CUDA machine the same code reports torch.cuda.max_memory_allocated instead of RSS.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import resource
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from qkv.config import from_dict, to_dict
from qkv.experiments.parts import build_run
from qkv.experiments.suite import RunSpec, Suite


def _rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _child(suite_dict: dict[str, Any], spec_dict: dict[str, Any], out_path: str, threads: int) -> None:
    torch.set_num_threads(threads)  # the parent's setting (spawned processes start with torch's default)

    suite = from_dict(Suite, suite_dict, "suite")
    spec = RunSpec(**spec_dict)
    model, task, _ = build_run(suite, spec)
    train = spec.train
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).train()
    if train.get("grad_checkpointing"):
        model.set_gradient_checkpointing(True)
    bf16 = train.get("precision", "fp32") == "bf16"
    opt = torch.optim.AdamW(model.parameters(), lr=float(train.get("lr", 1e-4)))
    bs = suite.efficiency.batch_size or int(train.get("batch_size", 8))
    batches = [{k: v.to(device) for k, v in task.batch(i, bs).items()}
               for i in range(suite.efficiency.warmup_steps + suite.efficiency.steps)]
    n_tok = int(batches[0]["input_ids"].numel())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = _rss_mb()
    times, losses = [], []
    for i, b in enumerate(batches):
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(**b)
        out.loss.float().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        losses.append(out.loss.detach().item())
        if i >= suite.efficiency.warmup_steps:
            times.append(dt)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20 - base
    else:
        # ru_maxrss and the /proc RSS read for `base` count pages slightly differently: a tiny model whose
        # steps allocate (almost) nothing can read a few KB below zero, which means "no measurable growth"
        peak = max(0.0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0 - base)
    step = statistics.median(times)
    res = {"step_ms": step * 1000, "peak_mb": peak, "tokens_per_s": n_tok / step, "final_loss": losses[-1],
           "losses": losses, "device": str(device), "params": model.num_parameters(), "batch_tokens": n_tok,
           "threads": torch.get_num_threads()}
    Path(out_path).write_text(json.dumps(res), encoding="utf-8")


def efficiency_run(suite: Suite, spec: RunSpec, run_dir: Path) -> dict[str, Any]:
    """The runner's train_fn for efficiency suites: one spawned process per run."""

    out = run_dir / "efficiency.json"
    t0 = time.perf_counter()
    args = (to_dict(suite), asdict(spec), str(out), torch.get_num_threads())
    if suite.efficiency.isolate:
        p = mp.get_context("spawn").Process(target=_child, args=args)
        p.start()
        p.join()
        code = p.exitcode
    else:  # same process: peak memory is then the process's high-water mark so far (only for tests)
        _child(*args)
        code = 0
    wall = time.perf_counter() - t0
    if code != 0 or not out.is_file():
        return {"error": f"efficiency process exited with code {code}", "diverged": True, "wall_s": wall,
                "metric": float("nan")}
    res = json.loads(out.read_text(encoding="utf-8"))
    with (run_dir / "metrics.jsonl").open("w", encoding="utf-8") as fh:
        for i, loss in enumerate(res.pop("losses")):
            fh.write(json.dumps({"step": i + 1, "loss": loss}) + "\n")
    res.update({"wall_s": wall, "metric": res["step_ms"], "diverged": False, "error": None})
    return res


def interleaved_timing(suite: Suite, specs: list[RunSpec], rounds: int | None = None) -> dict[str, float]:
    """Median step time (ms) of every variant, measured in this process with the variants' steps interleaved
    round-robin (A B C A B C ...), so that a machine whose speed drifts (shared cores) slows every variant
    alike; the separate-process step times are kept as step_ms_isolated."""

    eff = suite.efficiency
    rounds = rounds or eff.steps
    setups = []
    for spec in specs:
        if spec.seed != specs[0].seed:
            continue
        model, task, _ = build_run(suite, spec)
        model.train()
        if spec.train.get("grad_checkpointing"):
            model.set_gradient_checkpointing(True)
        bf16 = spec.train.get("precision", "fp32") == "bf16"
        opt = torch.optim.AdamW(model.parameters(), lr=float(spec.train.get("lr", 1e-4)))
        bs = eff.batch_size or int(spec.train.get("batch_size", 8))
        setups.append((spec.variant, model, opt, bf16, task.batch(0, bs)))
    times: dict[str, list[float]] = {v: [] for v, *_ in setups}
    for r in range(eff.warmup_steps + rounds):
        for variant, model, opt, bf16, batch in setups:
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(**batch)
            out.loss.float().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if r >= eff.warmup_steps:
                times[variant].append(time.perf_counter() - t0)
    return {v: statistics.median(ts) * 1000 for v, ts in times.items()}


def add_ratios(results: list[dict[str, Any]]) -> None:
    """speedup and memory_ratio of every run against the first variant's mean (same seed set)."""
    if not results:
        return
    first = results[0]["variant"]
    base = [r for r in results if r["variant"] == first and r.get("step_ms")]
    if not base:
        return
    t = statistics.fmean(r["step_ms"] for r in base)
    m = statistics.fmean(r["peak_mb"] for r in base)
    for r in results:
        if r.get("step_ms"):
            r["speedup"] = t / r["step_ms"]
            r["memory_ratio"] = r["peak_mb"] / m if m > 0 else float("nan")
