"""Activation (gradient) checkpointing: peak training-step memory and step time, with and without.

Model: `gpt-bench` (6L/6H/384) with context_length 1024, batch 8 (4 with --quick), fp32, dropout 0,
trained through qkv.train.Trainer with grad_checkpointing off/on.

How memory is measured (CPU, no torch.cuda): each variant runs in its own process, started with glibc's
mmap threshold pinned at 64 KiB (MALLOC_MMAP_THRESHOLD_), so every tensor bigger than that is its own
mmap and returns to the OS when freed -- the resident set then tracks live tensors instead of the
allocator's cache. After a warm-up step (AdamW state allocated), the kernel's peak-RSS counter is reset
(`echo 5 > /proc/self/clear_refs`) and the baseline RSS read; after the next step VmHWM is the step's
peak. "Peak above baseline" therefore holds activations, temporaries and the gradients (allocated in
backward, freed by zero_grad(set_to_none=True)); "activations" subtracts the gradients' size (4 bytes x
parameters), which is the same in both variants. Step time: median over the timed steps of all rounds;
variants alternate (ABBA) across rounds so machine drift hits both.

    .venv/bin/python benchmarks/activation_checkpointing.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # kB -> bytes
    raise RuntimeError(f"{key} not in /proc/self/status")


def child(args: argparse.Namespace) -> None:
    import torch

    import qkv
    from qkv.train import LambdaCallback, TrainConfig, Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = qkv.build("gpt-bench", context_length=args.context, dropout=0.0)
    mem: dict[str, int] = {}
    times: list[float] = []

    def on_step_start(tr, step):
        if step == 2:  # after the warm-up step: optimizer state exists, grads were freed
            Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS counter (VmHWM)
            mem["baseline"] = _status("VmRSS")

    def on_step_end(tr, step, rec):
        if step == 2:
            mem["peak"] = _status("VmHWM")
        if step >= 2:
            times.append(rec["step_time_s"])

    class Data:
        def batch(self, index, batch_size, split="train"):
            g = torch.Generator().manual_seed(index)
            x = torch.randint(0, model.config.vocab_size, (batch_size, args.context), generator=g)
            return {"input_ids": x, "labels": x}

    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(max_steps=args.steps + 1, batch_size=args.batch,
                          grad_checkpointing=args.child == "ckpt",
                          out_dir=tmp, progress=False, tensorboard=False, plot=False, log_every=1000)
        Trainer(model, cfg, Data(), callbacks=[LambdaCallback(on_step_start=on_step_start,
                                                              on_step_end=on_step_end)]).fit()
    grads = 4 * model.num_parameters()
    print(json.dumps({"baseline": mem["baseline"], "peak": mem["peak"], "grads": grads, "times": times}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per process (after 1 warm-up)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--child", choices=["plain", "ckpt"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.batch = args.batch or (4 if args.quick else 8)
    args.steps = args.steps or (2 if args.quick else 3)
    args.rounds = args.rounds or (1 if args.quick else 2)
    if args.child:
        child(args)
        return

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
    results: dict[str, list[dict]] = {"plain": [], "ckpt": []}
    for r in range(args.rounds):
        for variant in (["plain", "ckpt"] if r % 2 == 0 else ["ckpt", "plain"]):
            cmd = [sys.executable, __file__, "--child", variant, "--context", str(args.context), "--batch",
                   str(args.batch), "--steps", str(args.steps), "--threads", str(args.threads)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            results[variant].append(res)
            print(f"round {r + 1} {variant}: peak above baseline "
                  f"{(res['peak'] - res['baseline']) / 2**20:,.0f} MiB, step "
                  f"{statistics.median(res['times']):.2f} s", flush=True)

    def summarise(rs):
        above = statistics.median(x["peak"] - x["baseline"] for x in rs)
        act = statistics.median(x["peak"] - x["baseline"] - x["grads"] for x in rs)
        t = statistics.median(t for x in rs for t in x["times"])
        return above, act, t

    p_above, p_act, p_t = summarise(results["plain"])
    c_above, c_act, c_t = summarise(results["ckpt"])
    mem_saving = 1 - c_act / p_act
    time_cost = c_t / p_t - 1
    import torch

    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
               f"{torch.__version__}, {args.threads or torch.get_num_threads()} threads")
    md = [f"| gpt-bench 6L/384, context {args.context}, batch {args.batch}, fp32 | no checkpointing | "
          "checkpointing |",
          "|---|---|---|",
          f"| peak step memory above baseline (MiB) | {p_above / 2**20:,.0f} | {c_above / 2**20:,.0f} |",
          f"| of which activations + temporaries (MiB) | {p_act / 2**20:,.0f} | {c_act / 2**20:,.0f} "
          f"({-mem_saving:+.0%}) |",
          f"| step time (s, median) | {p_t:.2f} | {c_t:.2f} ({time_cost:+.0%}) |",
          "",
          f"Bar (>= 40% less activation memory at <= 40% more step time): "
          f"{'met' if mem_saving >= 0.4 and time_cost <= 0.4 else 'NOT met'}. Machine: {machine}."]
    table = "\n".join(md)
    print(table)
    result = {"machine": machine, "context": args.context, "batch": args.batch, "steps": args.steps,
              "rounds": args.rounds, "raw": results,
              "plain": {"peak_above_baseline": p_above, "activations": p_act, "step_s": p_t},
              "ckpt": {"peak_above_baseline": c_above, "activations": c_act, "step_s": c_t},
              "activation_saving": mem_saving, "time_cost": time_cost}
    out = ROOT / "results"
    out.mkdir(exist_ok=True)
    (out / "activation_checkpointing.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "activation_checkpointing.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
