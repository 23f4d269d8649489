"""Generation speed: qkv with a KV cache vs qkv without vs Hugging Face GPT2LMHeadModel.generate().

Model: the 'gpt-bench' preset size (6 layers, 6 heads, 384 wide, vocab 65, GPT-2 architecture; context 512 so
that prompt 16 + 256 new tokens fit, the preset has 256), built as a random GPT2Config in Hugging Face, saved
to a temporary folder and loaded into qkv through the interop loader (qkv.from_pretrained), so both libraries
decode with the SAME weights. Prompt 16 tokens, 256 new tokens, greedy, CPU fp32, batch 1 and 8. Every
configuration runs `--repeats` times, interleaved (round robin), and the table reports medians; the machine is
shared, so only ratios within one run count. Also: bf16 weights (ours, cached): speed and how many greedy
tokens agree with fp32.

    .venv/bin/python benchmarks/generate.py [--quick]
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
from qkv.generate import generate  # noqa: E402


def build_models(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=65, n_positions=512, n_embd=384, n_layer=6, n_head=6, bos_token_id=0,
                     eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = GPT2LMHeadModel(cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = qkv.from_pretrained(d).eval()
    return hf, ours


def timed(fn) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats (smoke test)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--no-nocache", action="store_true", help="skip the slow no-cache runs")
    a = ap.parse_args()
    if a.quick:
        a.repeats, a.new = 2, 32
    torch.manual_seed(0)
    hf, ours = build_models()
    import copy

    ours_bf16 = copy.deepcopy(ours).to(torch.bfloat16)
    V = 65
    rows, agree = [], {}
    for B in a.batches:
        g = torch.Generator().manual_seed(B)
        x = torch.randint(0, V, (B, a.prompt), generator=g)
        n_new = a.new
        configs = {
            "qkv cache": lambda x=x, n_new=n_new: generate(ours, x, n_new),
            "HF generate (cache)": lambda x=x, n_new=n_new: hf.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=n_new, do_sample=False,
                pad_token_id=0),
            "qkv cache bf16": lambda x=x, n_new=n_new: generate(ours_bf16, x, n_new),
        }
        if not a.no_nocache:
            configs["qkv no cache"] = lambda x=x, n_new=n_new: generate(ours, x, n_new, use_cache=False)
        for fn in configs.values():  # warm-up
            fn()
        times: dict[str, list[float]] = {k: [] for k in configs}
        outs: dict[str, torch.Tensor] = {}
        reps = {k: (max(1, a.repeats // 2) if k == "qkv no cache" else a.repeats) for k in configs}
        for r in range(a.repeats):
            for k, fn in configs.items():
                if r < reps[k]:
                    t, outs[k] = timed(fn)
                    times[k].append(t)
        ref = outs["qkv cache"]
        hf_eq = bool(torch.equal(outs["HF generate (cache)"], ref))
        bf_agree = float((outs["qkv cache bf16"][:, a.prompt:] == ref[:, a.prompt:]).float().mean())
        diff = outs["qkv cache bf16"][:, a.prompt:] != ref[:, a.prompt:]
        first_diff = [int(r.nonzero()[0]) if r.any() else None for r in diff]
        agree[B] = {"hf_tokens_equal": hf_eq, "bf16_token_agreement": bf_agree, "bf16_first_diff": first_diff}
        med = {k: statistics.median(v) for k, v in times.items()}
        for k in configs:
            tok_s = B * n_new / med[k]
            rows.append({"batch": B, "config": k, "median_s": round(med[k], 4),
                         "ms_per_step": round(1000 * med[k] / n_new, 3), "tok_per_s": round(tok_s, 1),
                         "vs_hf": round(med["HF generate (cache)"] / med[k], 3),
                         "vs_nocache": round(med["qkv no cache"] / med[k], 3) if "qkv no cache" in med
                             else None,
                         "repeats": len(times[k])})
    lines = ["| batch | config | ms/step | tok/s | x HF | x no-cache |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['config']} | {r['ms_per_step']} | {r['tok_per_s']} | {r['vs_hf']} "
                     f"| {r['vs_nocache'] if r['vs_nocache'] is not None else '-'} |")
    for B, d in agree.items():
        lines.append("")
        lines.append(f"batch {B}: greedy tokens identical to HF: {d['hf_tokens_equal']}; bf16 vs fp32 token "
                     f"agreement {d['bf16_token_agreement']:.3f} (first differing step per row: "
                     f"{d['bf16_first_diff']})")
    table = "\n".join(lines)
    meta = {"omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": platform.processor(),
            "prompt": a.prompt, "new_tokens": a.new, "repeats": a.repeats, "quick": a.quick}
    out = ROOT / "results"
    out.mkdir(exist_ok=True)
    (out / "generate.json").write_text(json.dumps({"meta": meta, "rows": rows, "agreement": agree}, indent=2))
    (out / "generate.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
