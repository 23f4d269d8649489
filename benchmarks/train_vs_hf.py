"""Training throughput: qkv GPT vs Hugging Face GPT2LMHeadModel (attn_implementation="sdpa").

One training step = forward (with next-token loss) + backward + AdamW step + zero_grad, on the same
config for both: n_layer 6, n_head 6, n_embd 384, block 256, batch 8, vocab 65, fp32, CPU, dropout 0.
Both start from the SAME weights (the HF model is saved to a temporary folder and loaded into qkv through
qkv.from_pretrained), see the SAME batches, and use the same optimizer settings; the first step's losses
are printed to show that both compute the same function.

Timing: `--warmup` steps each, then `--repeats` rounds; in every round each model runs `--steps` steps,
the order alternating between rounds (ABBA...), so drift of this shared machine hits both alike. The table
reports the median tokens/s of each and the median of the per-round ratios.

    .venv/bin/python benchmarks/train_vs_hf.py [--quick]
"""

from __future__ import annotations

import argparse
import json
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

N_LAYER, N_HEAD, N_EMBD, BLOCK, BATCH, VOCAB = 6, 6, 384, 256, 8, 65


def build_models(seed: int = 0):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=N_EMBD, n_layer=N_LAYER, n_head=N_HEAD,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                     attn_implementation="sdpa")  # transformers 5: set on the config
    hf = GPT2LMHeadModel(cfg)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = qkv.from_pretrained(d)
    assert hf.config._attn_implementation == "sdpa", hf.config._attn_implementation
    assert ours.config.dropout == 0.0 and ours.config.attn_dropout == 0.0
    return hf.train(), ours.train(), transformers.__version__


def make_step(model, lr: float = 3e-4):
    """One optimizer step (forward with loss, backward, AdamW, zero_grad) of `model` on a batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))

    def step(x: torch.Tensor) -> float:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 warmup step, 3 rounds of 1 step (smoke test)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3, help="steps per model per round")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args()
    if a.quick:
        a.warmup, a.repeats, a.steps = 1, 3, 1
    if a.threads:
        torch.set_num_threads(a.threads)

    hf, ours, tf_version = build_models()
    steps = {"qkv GPT": make_step(ours), "HF GPT2LMHeadModel (sdpa)": make_step(hf)}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (BATCH, BLOCK), generator=g) for _ in range(4)]
    tokens = BATCH * BLOCK

    first = {name: fn(batches[0]) for name, fn in steps.items()}  # same weights, same batch: same loss
    print("first-step loss: " + ", ".join(f"{k} {v:.6f}" for k, v in first.items()), flush=True)
    for fn in steps.values():
        for i in range(a.warmup - 1):
            fn(batches[(i + 1) % len(batches)])

    times: dict[str, list[float]] = {name: [] for name in steps}
    # process CPU seconds: robust to a busy machine
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for r in range(a.repeats):
        for name in (order if r % 2 == 0 else order[::-1]):
            t0, c0 = time.perf_counter(), time.process_time()
            for s in range(a.steps):
                steps[name](batches[s % len(batches)])
            times[name].append((time.perf_counter() - t0) / a.steps)
            cpu[name].append((time.process_time() - c0) / a.steps)
        print(f"round {r + 1}/{a.repeats}: " + ", ".join(f"{k} {tokens / v[-1]:.0f} tok/s"
                                                             for k, v in times.items()),
              flush=True)

    ours_name, hf_name = order[:2]
    ratios = [h / o for o, h in zip(times[ours_name], times[hf_name])]
    cpu_ratios = [h / o for o, h in zip(cpu[ours_name], cpu[hf_name])]
    rows = []
    for name in order:
        med = statistics.median(times[name])
        rows.append({"model": name, "median_step_s": med, "tokens_per_s": tokens / med,
                     "min_step_s": min(times[name]), "max_step_s": max(times[name]),
                     "median_cpu_s_per_step": statistics.median(cpu[name]),
                     "ratio_vs_hf": statistics.median([h / o for o, h in zip(times[name], times[hf_name])])})
    ratio = statistics.median(ratios)
    result = {
        "benchmark": "train_vs_hf",
        "config": {"n_layer": N_LAYER, "n_head": N_HEAD, "n_embd": N_EMBD, "block": BLOCK, "batch": BATCH,
                   "vocab": VOCAB, "dtype": "float32", "device": "cpu", "dropout": 0.0,
                   "optimizer": "AdamW(lr=3e-4, wd=0.1, betas=(0.9, 0.95)), torch default (foreach)"},
        "warmup": a.warmup, "repeats": a.repeats, "steps_per_round": a.steps,
        "rows": rows, "ratio_per_round": ratios, "ratio_median": ratio,
        "cpu_time_ratio_per_round": cpu_ratios, "cpu_time_ratio_median": statistics.median(cpu_ratios),
        "ratio_min": min(ratios), "ratio_max": max(ratios), "bar": 1.1, "meets_bar": ratio >= 1.1,
        "first_step_loss": first,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "capability": torch.backends.cpu.get_cpu_capability(),
                    "torch": torch.__version__, "transformers": tf_version,
                    "python": platform.python_version()},
    }
    md = [
        "| model | median step (s) | tokens/s | min..max step (s) | CPU s/step | vs HF |",
        "|---|---:|---:|---:|---:|---:|",
        *[f"| {r['model']} | {r['median_step_s']:.3f} | {r['tokens_per_s']:.0f} | "
          f"{r['min_step_s']:.3f}..{r['max_step_s']:.3f} | {r['median_cpu_s_per_step']:.3f} | "
          f"{r['ratio_vs_hf']:.2f}x |" for r in rows],
        "",
        f"qkv / HF throughput: median of per-round ratios **{ratio:.2f}x** (range "
        f"{min(ratios):.2f}..{max(ratios):.2f}, {a.repeats} rounds x {a.steps} steps, {a.warmup} warmup; bar "
        f"1.1x: {'met' if ratio >= 1.1 else 'NOT met'}).",
        f"Process-CPU-time ratio (less sensitive to other load on the machine): "
        f"{statistics.median(cpu_ratios):.2f}x. CPU capability {torch.backends.cpu.get_cpu_capability()}.",
        f"torch {torch.__version__}, transformers {tf_version}, {torch.get_num_threads()} threads.",
    ]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_vs_hf.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out / "train_vs_hf.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    print("\n".join(md))


if __name__ == "__main__":
    main()
