"""LoRA vs full fine-tuning: the time of one training step at the same batch, side by side in one run.

Model: a random Llama-style decoder on qkv's blocks (RMSNorm, SwiGLU, RoPE, GQA, no biases, tied head) of a
135M-class shape by default: 30 layers, hidden 576, 9 query / 3 key-value heads, intermediate 1536,
vocab 49152. One step = forward + backward + AdamW update (clip 1.0) on a batch of random token ids with
labels, the same loop as qkv.train.Trainer's inner step without its logging. Modes:
    full   every parameter trains
    lora   LoRA adapters (qkv.finetune.lora) on q,v (the LoRA paper's default) and on all-linear, rank 8
Each round builds each mode's model fresh from the same seed and times `--steps` steps after 1 warm-up step;
the order of the modes alternates between rounds (ABBA) so that drift on a shared machine hits them alike.
Reported: the median step time per mode over all timed steps, its ratio to full fine-tuning, the trainable
parameters and the AdamW state they need (2 fp32 moments each: computed, not measured). On a machine shared
with other jobs the wall clock measures this process's share of the CPU; with --threads 1 the CPU seconds of
this process (time.process_time) do not depend on that share, so both are reported.

    .venv/bin/python benchmarks/finetune.py [--quick] [--layers N] [--batch B] [--seq T] [--rounds R]
        [--threads N] [--out DIR]      -> DIR/finetune.json and DIR/finetune.md (default benchmarks/results)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from qkv.finetune.lora import LoRAConfig, apply_lora  # noqa: E402
from qkv.models.gpt import GPT, GPTConfig  # noqa: E402
from qkv.train.optim import build_optimizer  # noqa: E402

MODES = {"full": None, "lora q,v r8": ["q", "v"], "lora all-linear r8": ["all-linear"]}


def model_config(layers: int, quick: bool) -> GPTConfig:
    if quick:
        return GPTConfig(vocab_size=256, n_layers=layers, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128,
                         context_length=64, ffn="swiglu", norm="rmsnorm", position="rope", bias=False)
    return GPTConfig(vocab_size=49152, n_layers=layers, d_model=576, n_heads=9, n_kv_heads=3, d_ff=1536,
                     context_length=2048, ffn="swiglu", norm="rmsnorm", position="rope",
                     bias=False, norm_eps=1e-5)


def build(cfg: GPTConfig, targets: list[str] | None) -> GPT:
    torch.manual_seed(0)
    model = GPT(cfg)
    if targets is not None:
        apply_lora(model, LoRAConfig(rank=8, alpha=16, dropout=0.0, targets=targets))
    return model.train()


def time_steps(model: GPT, batch: dict, steps: int) -> tuple[list[float], list[float]]:
    opt, _ = build_optimizer(model, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    times, cpu = [], []
    for i in range(steps + 1):  # step 0 warms up (allocations, oneDNN kernels)
        t0, c0 = time.perf_counter(), time.process_time()
        out = model(**batch)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return times, cpu


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, one round: a smoke test")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 30; 2 with --quick)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; 1 with --quick)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per mode per round (default 3; 2 quick)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "results"))
    a = p.parse_args(argv)
    layers = a.layers or (2 if a.quick else 30)
    rounds = a.rounds or (1 if a.quick else 3)
    steps = a.steps or (2 if a.quick else 3)
    seq = min(a.seq, 32) if a.quick else a.seq
    torch.set_num_threads(a.threads)
    cfg = model_config(layers, a.quick)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, seq), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    info: dict[str, dict] = {}
    for r in range(rounds):
        order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
        for mode in order:
            model = build(cfg, MODES[mode])
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            info[mode] = {"trainable": trainable, "total": model.num_parameters(),
                          "adamw_state_mb": 2 * 4 * trainable / 1e6}
            wall, proc = time_steps(model, batch, steps)
            times[mode] += wall
            cpu[mode] += proc
            del model
    full, full_cpu = statistics.median(times["full"]), statistics.median(cpu["full"])
    rows = []
    for mode in MODES:
        med, med_cpu = statistics.median(times[mode]), statistics.median(cpu[mode])
        rows.append({"mode": mode, "median_step_s": med, "ratio_to_full": med / full, "median_cpu_s": med_cpu,
                     "cpu_ratio_to_full": med_cpu / full_cpu, "steps_timed": len(times[mode]),
                     "step_times_s": times[mode], "cpu_times_s": cpu[mode], **info[mode]})
    result = {"benchmark": "finetune", "quick": a.quick, "layers": layers, "batch": a.batch, "seq": seq,
              "rounds": rounds, "steps_per_round": steps, "threads": a.threads, "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "config": {
                  k: getattr(cfg, k)
                      for k in ("vocab_size", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff")},
              "rows": rows}
    lines = [f"LoRA vs full fine-tuning, one training step (fwd + bwd + AdamW), batch {a.batch} x {seq} "
             f"tokens, {layers} layers, {a.threads} threads, median of {rounds} x {steps} interleaved steps",
             "",
             "| mode | step (s, wall) | vs full | step (CPU s of this process) | vs full | trainable params "
             "| AdamW state (MB, computed) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['median_step_s']:.3f} | {r['ratio_to_full']:.2f}x | "
                     f"{r['median_cpu_s']:.3f} | {r['cpu_ratio_to_full']:.2f}x | "
                     f"{r['trainable']:,} of {r['total']:,} | {r['adamw_state_mb']:.1f} |")
    table = "\n".join(lines)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "finetune.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "finetune.md").write_text(table + "\n")
    print(table)
    return result


if __name__ == "__main__":
    main()
