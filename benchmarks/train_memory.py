"""`qkv info --train`'s estimate against the measured peak of a training step, over several model sizes.

For each model (GPT-family presets and a Llama-style variant: SwiGLU, RMSNorm, RoPE, grouped-query attention),
batch and sequence length, with and without gradient checkpointing: qkv.memory.train_memory's peak, and the
peak of live tensor storage over one fp32 AdamW step (forward, loss, backward, clipping, the fused update,
zero_grad), measured with qkv.memory.LiveTensorBytes after a first step made the optimizer's state. The
measure counts tensors (every storage an operator returns, until freed), not the allocator's cache or a
kernel's scratch: the quantity the estimate predicts. Memory does not depend on the machine's load, so one
run suffices; the table gives the ratio estimate / measured.

    .venv/bin/python benchmarks/train_memory.py [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))
sys.path.insert(0, str(ROOT))

import qkv  # noqa: E402
from _timing import write_results  # noqa: E402
from qkv.memory import LiveTensorBytes, train_memory  # noqa: E402
from qkv.train.optim import build_optimizer  # noqa: E402

LLAMA_STYLE = {"ffn": "swiglu", "norm": "rmsnorm", "position": "rope", "n_kv_heads": 2, "bias": False}
CASES = [  # (label, preset, overrides, batch, seq)
    ("gpt-nano", "gpt-nano", {}, 16, 32),
    ("gpt-tiny", "gpt-tiny", {}, 8, 64),
    ("gpt-tiny, naive attention", "gpt-tiny", {"attention": "naive"}, 8, 64),
    ("gpt-tiny, Llama-style", "gpt-tiny", LLAMA_STYLE, 8, 64),
    ("gpt-bench", "gpt-bench", {}, 8, 256),
    ("gpt-bench, Llama-style", "gpt-bench", LLAMA_STYLE, 8, 256),
    ("gpt-bench, batch 2", "gpt-bench", {}, 2, 256),
]


def measured_peak(model: torch.nn.Module, batch: int, seq: int, checkpointing: bool) -> int:
    model.train()
    model.set_gradient_checkpointing(checkpointing)
    opt, _ = build_optimizer(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    x = torch.randint(0, model.config.vocab_size, (batch, seq))

    def step() -> None:
        model(x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    mem = LiveTensorBytes()
    mem.hold([*model.parameters(), *model.buffers(), *(t for s in opt.state.values() for t in s.values())])
    with mem:
        step()
    return mem.peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the two smallest models (smoke test)")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args()
    cases = CASES[:2] if a.quick else CASES
    rows = []
    for label, preset, kw, batch, seq in cases:
        for ckpt in (False, True):
            torch.manual_seed(0)
            model = qkv.build(preset, **{"dropout": 0.0, **kw})
            est = train_memory(model, batch, seq)
            got = measured_peak(model, batch, seq, ckpt)
            rows.append({"model": label, "params": sum(p.numel() for p in model.parameters()), "batch": batch,
                         "seq": seq, "checkpointing": ckpt, "estimate_bytes": est.peak(ckpt),
                         "measured_bytes": got, "ratio": round(est.peak(ckpt) / got, 3),
                         "activations_estimate": est.activations_checkpointed if ckpt else est.activations})
    mib = 2 ** 20
    lines = ["| model | params | batch x seq | checkpointing | estimate MiB | measured MiB | estimate / "
             "measured |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['params']:,} | {r['batch']} x {r['seq']} | "
                     f"{'yes' if r['checkpointing'] else 'no'} | {r['estimate_bytes'] / mib:,.1f} | "
                     f"{r['measured_bytes'] / mib:,.1f} | {r['ratio']:.3f} |")
    worst = max(abs(r["ratio"] - 1) for r in rows)
    lines += ["", f"largest deviation: {100 * worst:.1f}% (fp32, AdamW; the measure counts live tensor "
                  "storage)"]
    meta = {"torch": torch.__version__, "machine": platform.processor(), "quick": a.quick}
    stem = "train_memory_quick" if a.quick else "train_memory"
    write_results(a.out, stem, {"meta": meta, "rows": rows}, lines)


if __name__ == "__main__":
    main()
