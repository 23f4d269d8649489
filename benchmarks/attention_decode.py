"""One decoding step at a growing context: multi-head, grouped-query, multi-query and latent attention at the
same width.

Four random-weight qkv GPT models of one width and depth (4 layers, d_model 512, 8 heads of 64, SwiGLU d_ff
1408, RoPE, RMSNorm, vocab 4096) differ only in the attention's key/value layout:

  MHA  8 key/value heads           cache per token and layer 2 x 8 x 64 = 1,024 numbers
  GQA  2 key/value heads           2 x 2 x 64 = 256
  MQA  1 key/value head            2 x 1 x 64 = 128
  MLA  latent 128 + rotary key 32  (DeepSeek-V2-Lite's proportions by width: kv_lora_rank d/4, rope head/2,
                                    nope = v = 64, no query compression)   128 + 32 = 160

Timed: model.step(one token, cache) at batch 1 over a cache already holding N tokens (the decoding step that
generate() and the Engine run: MLA's in the absorbed form, attending over the cached latent), for N in
--lengths. The caches are filled with random numbers and rewound to N before every step: a step's cost does
not depend on the cached values, and no prefill of N tokens is paid. CPU time of this process
(time.process_time: on a shared machine wall time mostly measures the other processes), one thread by
default; the variants interleaved round by round; medians of --repeats. Cache bytes per token (fp32, all
layers) are read from the caches the models allocate (qkv.nn.mla.cache_bytes_per_token).

    .venv/bin/python benchmarks/attention_decode.py [--quick] [--threads 1] [--lengths 256 1024 4096 16384]
        [--repeats 15] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import write_results  # noqa: E402

WIDTH = dict(family="gpt", d_model=512, n_heads=8, n_layers=4, d_ff=1408, ffn="swiglu", norm="rmsnorm",
             position="rope", bias=False, vocab_size=4096)
QUICK = dict(WIDTH, d_model=64, n_layers=2, d_ff=128)


def variants(width: dict) -> dict[str, dict]:
    """name -> the model's config fields: the width, and the attention's key/value layout."""
    d, h = width["d_model"], width["n_heads"]
    hd = d // h
    mla = {"kv_lora_rank": d // 4, "qk_nope_head_dim": hd, "qk_rope_head_dim": hd // 2, "v_head_dim": hd}
    return {"MHA": dict(width), "GQA": dict(width, n_kv_heads=h // 4), "MQA": dict(width, n_kv_heads=1),
            "MLA": dict(width, head_dim=hd // 2, mla=mla)}


def build_models(width: dict, context: int) -> dict:
    from qkv.models.registry import build

    models = {}
    for name, cfg in variants(width).items():
        torch.manual_seed(0)
        models[name] = build(dict(cfg, context_length=context)).eval()
    return models


def step_ms(models: dict, n: int, repeats: int) -> dict[str, list[float]]:
    """CPU ms of one decoding step over n cached tokens, per model, one sample per round."""
    caches = {}
    for name, m in models.items():
        cache = m.make_cache(1, n + 1)
        cache.k.normal_()
        cache.v.normal_()
        caches[name] = cache
    tok = torch.tensor([[7]])
    times: dict[str, list[float]] = {k: [] for k in models}
    with torch.no_grad():
        for r in range(repeats + 1):  # the first round warms up (allocator, first-call paths)
            for name, m in models.items():
                caches[name].length = n
                t = time.process_time()
                m.step(tok, caches[name])
                if r:
                    times[name].append((time.process_time() - t) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="a 2-layer 64-wide model, 64 tokens, 2 rounds")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = ap.parse_args()
    if a.quick:
        a.lengths, a.repeats = [64], 2
    torch.set_num_threads(a.threads)
    from qkv.nn.mla import cache_bytes_per_token

    width = QUICK if a.quick else WIDTH
    models = build_models(width, max(a.lengths) + 1)
    per_token = {k: cache_bytes_per_token(m.make_cache(1, 1)) for k, m in models.items()}
    rows = {n: step_ms(models, n, a.repeats) for n in a.lengths}
    names = list(models)
    lines = [f"{width['n_layers']} layers, d_model {width['d_model']}, {width['n_heads']} heads, batch 1, "
             f"fp32, {a.threads} thread(s), torch {torch.__version__}; CPU ms per step, median of "
             f"{a.repeats}",
             "", "| attention | params | cache bytes per token | "
             + " | ".join(f"step ms at {n:,}" for n in a.lengths) + " |",
             "|---|---|---|" + "---|" * len(a.lengths)]
    for k in names:
        ms = " | ".join(f"{statistics.median(rows[n][k]):.2f}" for n in a.lengths)
        lines.append(f"| {k} | {models[k].num_parameters():,} | {per_token[k]:,} | {ms} |")
    result = {"config": {**width, "threads": a.threads, "repeats": a.repeats, "lengths": a.lengths},
              "variants": {k: {"fields": variants(width)[k], "params": models[k].num_parameters(),
                               "cache_bytes_per_token": per_token[k],
                               "step_ms": {str(n): rows[n][k] for n in a.lengths},
                               "step_ms_median": {str(n): statistics.median(rows[n][k]) for n in a.lengths}}
                           for k in names}}
    write_results(a.out, "attention_decode_quick" if a.quick else "attention_decode", result, lines)


if __name__ == "__main__":
    main()
