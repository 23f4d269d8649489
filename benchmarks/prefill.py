"""Prefill of long prompts (512..2048 tokens): qkv vs transformers on the same weights.

One forward over a B=1 prompt of each length, logits of the last position only in both libraries (what
generation needs: qkv `model(ids, last_only=True)`, transformers `model(ids, logits_to_keep=1)`), under
torch.no_grad. Models (random weights, built by transformers from a config, saved to a temporary folder and
loaded by both):
  gpt2    GPT-2 124M (12 x 768, learned positions up to 2048 here so that 2048-token prompts fit)
  llama   a 135M-class Llama (30 x 576, 9/3 GQA heads, RoPE, RMSNorm, SwiGLU, tied)
Every (model, length) pair runs --repeats times with the two libraries interleaved (qkv, transformers, qkv,
...); the table gives medians, tok/s and the ratio. The last-position logits of the two are compared (max
absolute difference) so that a fast wrong answer cannot pass unseen.

    .venv/bin/python benchmarks/prefill.py [--quick] [--threads 2] [--lengths 512 1024 2048] [--repeats 3]

--quick: tiny configs, lengths 16 and 32, one repeat (the smoke test,
tests/benchmarks/test_benchmark_prefill.py).
--ablate: one more interleaved contender, "qkv full top block": the same model with every block over every
position and the LM head applied to the last one, so the table shows what last_only's skipping of the top
block's other queries and FFN rows buys on the same run.
Besides the wall-clock medians every call's process CPU time (user + sys of both threads) is recorded: on a
machine shared with other jobs it is far less noisy than wall time, and its ratio is given as well.
Writes OUT/prefill.json and prefill.md (OUT = benchmarks/results; --md also copies the table).
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
sys.path.insert(0, str(ROOT))

import qkv  # noqa: E402
from _timing import interleaved  # noqa: E402

FULL = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12,
                                                   n_head=12)),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                                      num_hidden_layers=30, num_attention_heads=9,
                                                      num_key_value_heads=3, max_position_embeddings=2048,
                                                      tie_word_embeddings=True)),
}
QUICK = {
    "gpt2": dict(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4),
    "llama": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True),
}
# dropout off in the saved configs, so that the folder both libraries load describes the inference model
NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "llama": {}}


def cpu_timed(fns: dict, cpu: dict) -> dict:
    """fns with each call's process CPU time (all threads, user + sys) appended to cpu[name]."""
    def wrap(k, fn):
        def call():
            c0 = time.process_time()
            out = fn()
            cpu[k].append(time.process_time() - c0)
            return out
        return call
    return {k: wrap(k, fn) for k, fn in fns.items()}


def build(name: str, quick: bool, tmp: Path, max_len: int):
    import transformers

    cfg_cls, model_cls, spec = FULL[name]
    spec = {**(QUICK[name] if quick else spec), **NO_DROPOUT[name]}
    spec["n_positions" if name == "gpt2" else "max_position_embeddings"] = max(max_len, 128)
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**spec)).eval()
    hf.save_pretrained(tmp / name)
    return hf, qkv.from_pretrained(tmp / name).eval()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true",
                    help="tiny configs, short prompts, one repeat (smoke test)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--families", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    ap.add_argument("--ablate", action="store_true",
                    help="also time qkv with its top block over every position")
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--md", default=None, help="also write the markdown table here")
    a = ap.parse_args(argv)
    if a.quick:
        a.lengths, a.repeats = [16, 32], 1
    torch.set_num_threads(a.threads)
    import transformers

    tmp = Path(tempfile.mkdtemp(prefix="qkv-prefill-"))
    rows = []
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in a.families:
            hf, ours = build(name, a.quick, tmp, max(a.lengths))
            for n in a.lengths:
                x = torch.randint(4, ours.output_vocab_size, (1, n), generator=gen)
                fns = {"qkv": lambda x=x, m=ours: m(x, last_only=True).logits[:, -1],
                       "transformers": lambda x=x, m=hf: m(x, logits_to_keep=1).logits[:, -1]}
                if a.ablate:  # the decoder over every position, then the LM head on the last one
                    fns["full_top"] = lambda x=x, m=ours: (
                        m.lm_head(m.decoder(m.tok_emb(x)).hidden[:, -1:])[:, -1])
                outs = {k: fn() for k, fn in fns.items()}  # warm-up, and the logits compared
                diff = max((o - outs["transformers"]).abs().max().item() for k, o in outs.items())
                cpu = {k: [] for k in fns}
                times, _ = interleaved(cpu_timed(fns, cpu), a.repeats)
                med = {k: statistics.median(v) for k, v in times.items()}
                cmed = {k: statistics.median(v) for k, v in cpu.items()}
                rows.append({"family": name, "tokens": n, "qkv_s": round(med["qkv"], 4),
                             "hf_s": round(med["transformers"], 4), "qkv_tok_s": round(n / med["qkv"], 1),
                             "hf_tok_s": round(n / med["transformers"], 1),
                             "speedup": round(med["transformers"] / med["qkv"], 3),
                             "max_abs_logit_diff": diff,
                             "qkv_cpu_s": round(cmed["qkv"], 4), "hf_cpu_s": round(cmed["transformers"], 4),
                             "cpu_speedup": round(cmed["transformers"] / cmed["qkv"], 3),
                             **({"full_top_s": round(med["full_top"], 4),
                                 "full_top_speedup": round(med["transformers"] / med["full_top"], 3)}
                                if a.ablate else {})})
            del hf, ours, fns  # free one model pair before building the next
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "threads": a.threads,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.processor() or platform.machine(),
            "repeats": a.repeats, "quick": a.quick, "ablate": a.ablate}
    ab_head = " qkv full top block s | its speed-up |" if a.ablate else ""
    lines = [f"fp32, batch 1, {a.threads} threads, CPU {meta['cpu_capability']}; one forward, last-position "
             f"logits; median of {a.repeats} interleaved repeats; CPU-time speed-up: the same ratio of the "
             "calls' process CPU time (user + sys, both threads)", "",
             "| model | prompt tokens | qkv s | transformers s | qkv tok/s | transformers tok/s | qkv "
             "speed-up | CPU-time speed-up | max abs logit diff |" + ab_head,
             "|---|---|---|---|---|---|---|---|---|" + "---|---|" * a.ablate]
    lines += [f"| {r['family']} | {r['tokens']} | {r['qkv_s']} | {r['hf_s']} | {r['qkv_tok_s']} | "
              f"{r['hf_tok_s']} | {r['speedup']}x | {r['cpu_speedup']}x | {r['max_abs_logit_diff']:.1e} |"
              + (f" {r['full_top_s']} | {r['full_top_speedup']}x |" if a.ablate else "") for r in rows]
    table = "\n".join(lines) + "\n"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "prefill_quick" if a.quick else "prefill"
    result = {"meta": meta, "rows": rows}
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (out / f"{stem}.md").write_text(table)
    if a.md:
        Path(a.md).write_text(table)
    print(table)
    return result


if __name__ == "__main__":
    main()
