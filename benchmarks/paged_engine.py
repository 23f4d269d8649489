"""Paged KV cache + continuous batching (qkv.generate.Engine) vs a static cache padded to the longest request.

32 requests of mixed lengths (prompts 4-64 tokens, 16-160 new tokens, fixed seed) on a 'gpt-bench'-sized
GPT (6 layers, 6 heads, 384 wide, vocab 65, random weights), greedy, CPU fp32.
  engine   Engine(block_size=16, max_batch_size=32): requests leave as soon as they are done; cache memory =
           peak blocks in use x block bytes.
  engine, decoding batch cut by length: the same with split_cost=4096 (the default, "auto", cuts it only
           where the paged step gathers K/V: not on the CPU)
  static   one generate() call over the 32 left-padded prompts with max_new_tokens = the longest request
           (every row runs until the longest is done); cache memory = B x (longest prompt + longest new)
           slots.
Throughput counts only the tokens each request asked for. Runs are interleaved, medians reported.

    .venv/bin/python benchmarks/paged_engine.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

import qkv  # noqa: E402
from _timing import interleaved  # noqa: E402
from qkv.generate import Engine, generate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "results" / "paged_engine.json"),
                    help="JSON path (+ .md beside it)")
    a = ap.parse_args()
    max_new_hi = 40 if a.quick else 160
    if a.quick:
        a.repeats = 1
    torch.manual_seed(0)
    m = qkv.build("gpt-bench", context_length=256).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 65, (int(torch.randint(4, 65, (1,), generator=g)),), generator=g).tolist()
               for _ in range(a.requests)]
    news = [int(torch.randint(16, max_new_hi + 1, (1,), generator=g)) for _ in range(a.requests)]
    useful = sum(news)
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    c = m.config
    slot_bytes = 2 * c.n_layers * c.n_heads * (c.d_model // c.n_heads) * 4  # K and V, all layers, fp32

    def run_engine(split_cost="auto"):
        e = Engine(m, block_size=16, max_batch_size=32, split_cost=split_cost)
        rids = [e.add_request(p, n) for p, n in zip(prompts, news)]
        out = e.run()
        return [out[r] for r in rids], e.peak_blocks * e.cache.bytes_per_block, e.steps

    def run_static():
        out = generate(m, ids, max(news), attention_mask=mask)
        return [out[i, T : T + n].tolist()
                    for i, n in enumerate(news)], len(prompts) * (T + max(news)) * slot_bytes

    variants = {"engine (paged)": run_engine, "static (padded)": run_static,
                "engine, decoding batch cut by length (split_cost=4096)": lambda: run_engine(4096)}
    times, res = interleaved(variants, a.repeats)
    same = res["engine (paged)"][0] == res["static (padded)"][0] == res[next(reversed(variants))][0]
    needed = sum(len(p) + n - 1 for p, n in zip(prompts, news)) * slot_bytes  # positions actually cached
    rows = []
    for k in times:
        med = statistics.median(times[k])
        mem = res[k][1]
        rows.append({"config": k, "median_s": round(med, 3), "tok_per_s": round(useful / med, 1),
                     "cache_MiB": round(mem / 2**20, 2), "cache_vs_needed": round(mem / needed, 3)})
    static_s = statistics.median(times["static (padded)"])
    for r in rows:
        r["speed_vs_static"] = round(static_s / r["median_s"], 3)
    lines = ["| config | tok/s (useful) | vs static | peak cache memory (MiB) | memory / (sum of all "
             "requests' positions) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['tok_per_s']} | {r['speed_vs_static']}x | {r['cache_MiB']} | "
              f"{r['cache_vs_needed']} |"
              for r in rows]
    lines.append("")
    lines.append(f"{a.requests} requests, prompts {min(map(len, prompts))}-{T} tokens, new "
                 f"{min(news)}-{max(news)} tokens ({useful} useful); engine steps "
                 f"{res['engine (paged)'][2]}; tokens identical to the static cache: {same}")
    table = "\n".join(lines)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "repeats": a.repeats, "quick": a.quick}
    out.write_text(json.dumps({"meta": meta, "rows": rows, "tokens_identical": same}, indent=2))
    out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
