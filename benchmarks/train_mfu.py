"""Training throughput and model-FLOPs utilisation (MFU) of qkv.train.Trainer, fp32 vs bf16 autocast.

Model: preset `gpt-bench` (nanoGPT shakespeare_char size: n_layer 6, n_head 6, n_embd 384, block 256,
vocab 65), batch 8, dropout 0, AdamW, clip 1.0 -- the full Trainer loop (token-normalised accumulation,
non-finite guard, logging), not a bare forward/backward.

1. Peak: this machine's matmul throughput measured in the same run, right before each timed training
   run of the same dtype (square matmuls 1024..2048, best of the medians); MFU is computed per round
   against that round's peak and the median over rounds is reported.
2. Throughput: `--rounds` rounds; in each, an fp32 run and a bf16 run of `--steps` steps (order alternating
   ABBA so drift hits both alike), tokens/s = median of per-step (tokens / step time) after 2 warm-up steps.
   MFU = flops_per_token * tokens/s / peak, with PaLM's (Chowdhery et al. 2022, app. B) / nanoGPT's count
   flops_per_token = 6 * N + 12 * n_layer * n_embd * block   (N = parameters without position embeddings;
   the second term is attention's QK^T and AV, forward + backward)
   fp32 MFU is against the fp32 peak; bf16 MFU against the bf16 peak.
   On a machine shared with other jobs, wall-clock rates measure the share of the CPU this process got;
   with --threads 1 the rates per CPU second of this process (time.process_time) do not, so both are
   reported (with several threads, CPU time also counts spin-waiting, so prefer wall clock then).
3. Quality: the loss after `--loss-steps` steps on a learnable synthetic corpus (a fixed random bigram
   chain), fp32 vs bf16, same seed and batches: mean of the last 10 steps' losses.

    .venv/bin/python benchmarks/train_mfu.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

import qkv  # noqa: E402
from qkv.train import LambdaCallback, TrainConfig, Trainer  # noqa: E402

BATCH = 8


class BigramText:
    """A deterministic token stream from a fixed random bigram chain (each token has ~4 likely successors),
    cut into (batch, block) windows by index: learnable, so fp32 and bf16 losses can be compared."""

    def __init__(self, vocab: int, block: int, n_tokens: int = 400_000, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab, vocab, generator=g) * 3.0
        probs = torch.softmax(logits, dim=-1)
        stream = torch.empty(n_tokens, dtype=torch.long)
        stream[0] = 0
        # sample the chain in vectorised chunks: 64 independent chains interleaved is enough variety
        chains = n_tokens // 64
        cur = torch.randint(0, vocab, (64,), generator=g)
        cols = []
        for _ in range(chains):
            cur = torch.multinomial(probs[cur], 1, generator=g).squeeze(1)
            cols.append(cur)
        self.stream = torch.stack(cols, dim=1).reshape(-1)  # (64 chains, steps) -> chain after chain
        self.block = block

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(index * 2 + (split != "train"))
        starts = torch.randint(0, len(self.stream) - self.block - 1, (batch_size,), generator=g)
        x = torch.stack([self.stream[s : s + self.block] for s in starts.tolist()])
        return {"input_ids": x, "labels": x}


def matmul_peak(dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """Best median GFLOP/s of square matmuls n x n @ n x n: (per wall second, per CPU second of this
    process)."""
    kernels = [lambda a, b: a @ b]
    best_wall = best_cpu = 0.0
    for n in (1024, 1536, 2048):
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        for kernel in kernels:
            kernel(a, b)  # warm-up
            wall, cpu = [], []
            for _ in range(repeats):
                t, c = time.perf_counter(), time.process_time()
                kernel(a, b)
                wall.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
            best_wall = max(best_wall, 2 * n**3 / statistics.median(wall) / 1e9)
            best_cpu = max(best_cpu, 2 * n**3 / max(statistics.median(cpu), 1e-9) / 1e9)
    return best_wall, best_cpu


def flops_per_token(model: torch.nn.Module) -> float:
    c = model.config
    n = model.num_parameters()
    if c.position == "learned":
        n -= c.context_length * c.d_model
    return 6 * n + 12 * c.n_layers * c.d_model * c.context_length


def run(precision: str, steps: int, data: BigramText, out: str, seed: int = 0) -> dict:
    """Train `steps` steps; tokens/s per wall second and per CPU second of this process (the latter is what
    a time-sliced process actually computed in, so it survives other jobs on the machine with --threads 1)."""
    torch.manual_seed(seed)
    model = qkv.build("gpt-bench", dropout=0.0)
    wall, cpu, losses, t0 = [], [], [], {}
    tokens = BATCH * model.config.context_length

    def on_step_start(tr, step):
        t0["wall"], t0["cpu"] = time.perf_counter(), time.process_time()

    def on_step_end(tr, step, rec):
        wall.append(tokens / (time.perf_counter() - t0["wall"]))
        cpu.append(tokens / max(time.process_time() - t0["cpu"], 1e-9))
        losses.append(rec["loss"])

    cfg = TrainConfig(max_steps=steps, batch_size=BATCH, lr=1e-3, warmup=min(20, steps // 5 or 1),
                      schedule="cosine",
                      precision=precision, out_dir=out, progress=False, tensorboard=False, plot=False,
                      log_every=max(steps, 1), weight_decay=0.1, betas=[0.9, 0.99])
    cb = LambdaCallback(on_step_start=on_step_start, on_step_end=on_step_end)
    Trainer(model, cfg, data, callbacks=[cb]).fit()
    skip = 2 if len(wall) > 4 else 0  # warm-up steps
    return {"tok_s": statistics.median(wall[skip:]), "tok_cpu_s": statistics.median(cpu[skip:]),
            "losses": losses, "fpt": flops_per_token(model)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps and rounds (a smoke run, ~3 min)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--steps", type=int, default=None, help="steps per timed run")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--loss-steps", type=int, default=None,
                    help="steps of the fp32-vs-bf16 loss runs (0 = skip)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.steps or (8 if args.quick else 20)
    rounds = args.rounds or (1 if args.quick else 3)
    loss_steps = args.loss_steps if args.loss_steps is not None else (40 if args.quick else 200)
    data = BigramText(65, 256)

    reps = 3 if args.quick else 5
    keys = ("fp32", "bf16")
    tok = {k: [] for k in keys}
    tok_cpu = {k: [] for k in keys}
    peaks = {k: [] for k in keys}
    mfus = {k: [] for k in keys}
    mfus_cpu = {k: [] for k in keys}
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        fpt = 0.0
        for r in range(rounds):
            # the peak is re-measured next to each run: this machine's speed drifts within minutes
            got = {}
            for prec in (["fp32", "bf16"] if r % 2 == 0 else ["bf16", "fp32"]):
                peak, peak_cpu = matmul_peak(torch.float32 if prec == "fp32" else torch.bfloat16, reps)
                res = run(prec, steps, data, f"{tmp}/{prec}{r}")
                got[prec] = res["tok_s"]
                fpt = res["fpt"]
                tok[prec].append(res["tok_s"])
                tok_cpu[prec].append(res["tok_cpu_s"])
                peaks[prec].append([peak, peak_cpu])
                mfus[prec].append(fpt * res["tok_s"] / (peak * 1e9))
                mfus_cpu[prec].append(fpt * res["tok_cpu_s"] / (peak_cpu * 1e9))
                print(f"round {r + 1}/{rounds} {prec}: matmul peak {peak:.1f} GFLOP/s (wall) {peak_cpu:.1f} "
                      f"(CPU), {res['tok_s']:,.0f} tok/s (wall) {res['tok_cpu_s']:,.0f} (per CPU s), "
                      f"MFU {mfus[prec][-1]:.1%} (wall) {mfus_cpu[prec][-1]:.1%} (CPU)", flush=True)
            ratios.append(got["bf16"] / got["fp32"])
        if loss_steps:
            l32 = run("fp32", loss_steps, data, f"{tmp}/l32")["losses"]
            l16 = run("bf16", loss_steps, data, f"{tmp}/l16")["losses"]
        else:
            l32 = l16 = [float("nan")]
    loss32 = statistics.fmean(l32[-10:])
    loss16 = statistics.fmean(l16[-10:])

    t32, t16 = statistics.median(tok["fp32"]), statistics.median(tok["bf16"])
    c32, c16 = statistics.median(tok_cpu["fp32"]), statistics.median(tok_cpu["bf16"])
    peak32 = statistics.median(p[0] for p in peaks["fp32"])
    peak16 = statistics.median(p[0] for p in peaks["bf16"])
    cpeak32 = statistics.median(p[1] for p in peaks["fp32"])
    cpeak16 = statistics.median(p[1] for p in peaks["bf16"])
    mfu32, mfu16 = statistics.median(mfus["fp32"]), statistics.median(mfus["bf16"])
    cmfu32, cmfu16 = statistics.median(mfus_cpu["fp32"]), statistics.median(mfus_cpu["bf16"])
    speedup = statistics.median(ratios)
    loss_rel = abs(loss16 - loss32) / loss32
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"torch {torch.__version__}, {torch.get_num_threads()} threads",
        "quick": args.quick, "steps": steps, "rounds": rounds, "loss_steps": loss_steps,
        "flops_per_token": fpt, "peak_gflops": {"fp32": peak32, "bf16": peak16},
        "tokens_per_s": {"fp32": t32, "bf16": t16, "all": tok}, "bf16_speedup": speedup,
        "tokens_per_cpu_s": {"fp32": c32, "bf16": c16, "all": tok_cpu},
        "mfu": {"fp32_vs_fp32_peak": mfu32, "bf16_vs_bf16_peak": mfu16,
                "bf16_vs_fp32_peak": fpt * t16 / (peak32 * 1e9), "per_round": mfus},
        "mfu_cpu_time": {"fp32": cmfu32, "bf16": cmfu16, "per_round": mfus_cpu},
        "peaks_per_round_wall_cpu": peaks, "cpu_peak_gflops": {"fp32": cpeak32, "bf16": cpeak16},
        "loss_after": {"fp32": loss32, "bf16": loss16, "rel_diff": loss_rel},
        "bars": {"fp32_mfu>=0.8": mfu32 >= 0.8, "bf16>=1.6x": speedup >= 1.6,
                 "loss_within_2%": loss_rel <= 0.02},
    }
    rows = [
        ("matmul peak, GFLOP/s per wall s / per CPU s", f"{peak32:.1f} / {cpeak32:.1f}",
         f"{peak16:.1f} / {cpeak16:.1f}"),
        ("training tokens per wall s (median)", f"{t32:,.0f}", f"{t16:,.0f}"),
        ("training tokens per CPU s (median)", f"{c32:,.0f}", f"{c16:,.0f}"),
        ("MFU vs own-dtype peak, wall clock", f"{mfu32:.1%}", f"{mfu16:.1%}"),
        ("MFU vs own-dtype peak, CPU time", f"{cmfu32:.1%}", f"{cmfu16:.1%}"),
        ("speed vs fp32 (median of rounds)", "1.00x", f"{speedup:.2f}x"),
        (f"loss after {loss_steps} steps (mean of last 10)", f"{loss32:.4f}",
         f"{loss16:.4f} ({loss_rel:+.2%})"),
    ]
    md = ["| gpt-bench 6L/6H/384, block 256, batch 8 | fp32 | bf16 autocast |", "|---|---|---|"]
    md += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    md.append("")
    md.append(f"flops/token = 6N + 12*L*d*T = {fpt / 1e6:.1f} MFLOP; bars: fp32 MFU >= 80% "
              f"{'met' if mfu32 >= 0.8 else 'NOT met'}, bf16 >= 1.6x "
              f"{'met' if speedup >= 1.6 else 'NOT met'}, loss within 2% "
              f"{'met' if loss_rel <= 0.02 else 'NOT met'}. Machine: {result['machine']}.")
    table = "\n".join(md)
    print(table)
    out = ROOT / "results"
    out.mkdir(exist_ok=True)
    (out / "train_mfu.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "train_mfu.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
