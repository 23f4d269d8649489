"""A ResNet training step in the two memory layouts of a 4-D tensor: NCHW (torch's default) and channels_last
(NHWC), the one qkv's ResNet keeps its weights and activations in.

The model of configs/resnet10_fashion.yaml (ResNet-10, CIFAR stem, half width, 1.2M parameters) on a batch of
28x28 grey images: forward + backward + AdamW step, bf16 autocast as the config trains (`--fp32` for fp32).
The same weights in both layouts; the NCHW step runs the model's modules on contiguous tensors (the model's
own forward turns its input to channels_last). The two steps' losses are checked equal (to float rounding)
before timing. CPU time of this process (time.process_time: on a shared machine wall time mostly measures the
other processes), one thread by default; the layouts interleaved step by step; medians of --repeats. Wall time
per step too: with --threads 2 it says what a second core buys (CPU time sums the threads).

    .venv/bin/python benchmarks/conv_layout.py [--quick] [--threads 1] [--batch 128] [--repeats 9]
        [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _timing import write_results  # noqa: E402


def build(quick: bool) -> torch.nn.Module:
    from qkv.models.registry import build as build_model

    widths = [8, 16, 32, 64] if quick else [32, 64, 128, 256]
    return build_model("resnet-18-cifar-slim", depths=[1, 1, 1, 1], widths=widths, stem_width=widths[0],
                       zero_init_residual=True, n_channels=1, num_labels=10)


def nchw_loss(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The model's forward on contiguous (NCHW) tensors: stem, stages, pooling, classifier."""
    h = m.stem(x)
    for stage in m.stages:
        for block in stage:
            h = block(h)
    return F.cross_entropy(m.classifier(h.mean(dim=(2, 3))), y)


def stepper(m: torch.nn.Module, loss_fn, x, y, bf16: bool):
    opt = torch.optim.AdamW(m.parameters(), 1e-3)

    def step() -> float:
        cast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with cast:
            loss = loss_fn(m, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--fp32", action="store_true")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    batch, repeats = (16, 2) if a.quick else (a.batch, a.repeats)
    last = build(a.quick)  # channels_last, as the model builds itself
    first = copy.deepcopy(last).to(memory_format=torch.contiguous_format)
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    steps = {"NCHW": stepper(first, nchw_loss, x, y, not a.fp32),
             "channels_last": stepper(last, lambda m, x, y: m(x, labels=y).loss, x, y, not a.fp32)}
    losses = {k: step() for k, step in steps.items()}  # also the warm-up step
    tol = 1e-2 if not a.fp32 else 1e-4
    if abs(losses["NCHW"] - losses["channels_last"]) > tol * abs(losses["NCHW"]):
        raise SystemExit(f"the two layouts disagree: {losses}")
    times: dict[str, list[float]] = {k: [] for k in steps}
    walls: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for k, step in steps.items():
            t0, w0 = time.process_time(), time.perf_counter()
            step()
            times[k].append(time.process_time() - t0)
            walls[k].append(time.perf_counter() - w0)
    report(a, batch, times, walls, losses)


def report(a: argparse.Namespace, batch: int, times: dict[str, list[float]], walls: dict[str, list[float]],
           losses: dict[str, float]) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    wall = {k: statistics.median(v) for k, v in walls.items()}
    precision = "fp32" if a.fp32 else "bf16 autocast"
    lines = [f"ResNet-10 training step, batch {batch}, {precision}, {a.threads} thread(s), CPU time, "
             f"median of {len(times['NCHW'])}", "",
             "| layout | CPU ms per step | images per CPU-second | x NCHW | wall ms per step |",
             "|---|---|---|---|---|"]
    for k, t in med.items():
        lines.append(f"| {k} | {1000 * t:.1f} | {batch / t:.0f} | {med['NCHW'] / t:.2f} "
                     f"| {1000 * wall[k]:.1f} |")
    result = {"batch": batch, "threads": a.threads, "precision": precision, "first_loss": losses,
              "step_s": times, "median_s": med, "wall_step_s": walls, "median_wall_s": wall}
    write_results(a.out, "conv_layout_quick" if a.quick else "conv_layout", result, lines)


if __name__ == "__main__":
    main()
