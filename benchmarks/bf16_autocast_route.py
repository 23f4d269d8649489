"""qkv's fine-tuning step under bf16 autocast vs fp32, on a CPU without native bf16 (issue 14's bf16 row).

The model, batches and step of benchmarks/finetune_encoder.py (BERT-base shape with --layers layers, batch 16 x
seq 128 with padding, AdamW), qkv's side only, so that the full 12-layer form runs in minutes: transformers' side
under bf16 autocast runs emulated bf16 kernels (~1.5 min per layer-step here) and is measured by
finetune_encoder.py at a reduced --layers. Rows: qkv fp32; qkv bf16 autocast (on such a CPU its Linear and fused
attention take qkv.nn.linear.BF16_AUTOCAST_FP32's route: fp32 products of bf16-rounded operands); with --off-row
also qkv bf16 with the route off (autocast's own, emulated, kernels: slow, use a small --layers). Rounds ABBA,
medians of wall and process CPU time per step.

    .venv/bin/python benchmarks/bf16_autocast_route.py [--layers 12] [--warmup 1] [--repeats 3] [--off-row]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from _timing import write_results  # noqa: E402
from finetune_encoder import BASE, QUICK, batches, build_models, make_step  # noqa: E402
from qkv.nn import linear as qkv_linear  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="finetune_encoder's tiny model, 1 layer, 2 rounds (smoke test)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--off-row", action="store_true", help="also qkv bf16 with the route off (emulated kernels)")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    shape = dict(QUICK if a.quick else BASE)
    if a.quick:
        a.layers, a.warmup, a.repeats = 1, 1, 2
    _, ours, _ = build_models(shape, a.layers, "cpu")
    data = batches(shape, 3, "cpu")
    tokens = shape["batch"] * shape["seq"]
    rows = {"qkv BERT fp32": ("fp32", True), "qkv BERT bf16 (route)": ("bf16", True)}
    if a.off_row:
        rows["qkv BERT bf16 (route off: autocast's kernels)"] = ("bf16", False)
    steps = {name: make_step(copy.deepcopy(ours), dt, "cpu") for name, (dt, _) in rows.items()}

    def run(name: str, i: int) -> float:
        qkv_linear.BF16_AUTOCAST_FP32 = rows[name][1]
        try:
            return steps[name](data[i % len(data)])
        finally:
            qkv_linear.BF16_AUTOCAST_FP32 = True

    first = {name: run(name, 0) for name in rows}
    print("first-step loss: " + ", ".join(f"{k} {v:.6f}" for k, v in first.items()), flush=True)
    for name in rows:
        for i in range(a.warmup - 1):
            run(name, i + 1)
    wall: dict[str, list[float]] = {k: [] for k in rows}
    cpu: dict[str, list[float]] = {k: [] for k in rows}
    order = list(rows)
    for r in range(a.repeats):
        for name in (order if r % 2 == 0 else order[::-1]):
            t0, c0 = time.perf_counter(), time.process_time()
            run(name, r)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
        print(f"round {r + 1}/{a.repeats}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in wall.items()), flush=True)
    fp32 = "qkv BERT fp32"
    table = [{"row": k, "median_step_s": statistics.median(wall[k]), "tokens_per_s": tokens / statistics.median(wall[k]),
              "median_cpu_s": statistics.median(cpu[k]),
              "vs_fp32_time": statistics.median([w / f for w, f in zip(wall[k], wall[fp32])]),
              "vs_fp32_cpu_time": statistics.median([w / f for w, f in zip(cpu[k], cpu[fp32])])} for k in rows]
    lines = ["| row | median step (s) | tokens/s | median CPU s | step time vs fp32 | CPU time vs fp32 |",
             "|---|---:|---:|---:|---:|---:|",
             *[f"| {t['row']} | {t['median_step_s']:.3f} | {t['tokens_per_s']:.0f} | {t['median_cpu_s']:.3f} | "
               f"{t['vs_fp32_time']:.2f}x | {t['vs_fp32_cpu_time']:.2f}x |" for t in table], "",
             f"{a.layers} layers x hidden {shape['hidden']}, batch {shape['batch']} x seq {shape['seq']}, {a.repeats} "
             f"rounds (ABBA), {a.warmup} warmup, torch {torch.__version__}, {torch.get_num_threads()} threads, CPU "
             f"capability {torch.backends.cpu.get_cpu_capability()}, native bf16 {qkv_linear.native_bf16()}."]
    write_results(a.out, "bf16_autocast_route" + ("_quick" if a.quick else ""), {"benchmark": "bf16_autocast_route", "quick": a.quick, "layers": a.layers,
                                                 "warmup": a.warmup, "repeats": a.repeats, "rows": table,
                                                 "first_step_loss": first, "wall": wall, "cpu": cpu,
                                                 "native_bf16": qkv_linear.native_bf16(),
                                                 "torch": torch.__version__, "threads": torch.get_num_threads()},
                  lines)


if __name__ == "__main__":
    main()
