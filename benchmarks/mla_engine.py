"""Multi-head latent attention in the paged KV cache: the pool's size, and the Engine on a small DeepSeek-V3.

  pool     bytes per token and per 16-token block (all layers, bf16) of DeepSeek-V3's shape (61 layers, 128
           heads of 128; MLA caches the 512-wide latent and the 64-wide rotary key), read from the pools qkv
           allocates: PagedLatentCache (model.make_paged_cache of an MLA model) against the per-head
           PagedKVCache that multi-head / 8-group attention would need
  engine   benchmarks/mla.py's random DeepseekV3ForCausalLM (4 layers, hidden 256, 16 heads, kv_lora_rank
           128): --requests greedy requests with prompts of 16..64 tokens and --new tokens each, the Engine
           (paged latent cache, block 16, all requests batched) against generate() (static latent cache) one
           request at a time; the tokens are checked equal; tokens per CPU second

Measured as CPU time of this process (time.process_time), one thread by default.

    .venv/bin/python benchmarks/mla_engine.py [--quick] [--threads 1] [--requests 8] [--new 32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mla import build  # noqa: E402  (benchmarks/mla.py: the same model)


def pool_table() -> list[str]:
    from qkv.nn.paged import PagedKVCache
    from qkv.nn.paged_latent import PagedLatentCache

    L, bf, bs = 61, torch.bfloat16, 16
    rows = [("MLA, latent 512 + rotary key 64 (PagedLatentCache)",
             PagedLatentCache(L, 512, 64, 1, bs, dtype=bf)),
            ("MHA, 128 heads x 128 (PagedKVCache)", PagedKVCache(L, 128, 128, 1, bs, dtype=bf)),
            ("GQA, 8 key/value heads x 128 (PagedKVCache)", PagedKVCache(L, 8, 128, 1, bs, dtype=bf))]
    out = ["| paged pool | bytes per token (61 layers, bf16) | MiB per 16-token block | blocks in 80 GiB |",
           "|---|---|---|---|"]
    for name, cache in rows:
        held = cache.k.nbytes + cache.v.nbytes  # one block: what the pool really allocates per block
        assert held == cache.bytes_per_block == cache.bytes_per_token * bs
        out.append(f"| {name} | {cache.bytes_per_token:,} | {held / 2**20:.2f} | {80 * 2**30 // held:,} |")
    return out


def engine_vs_generate(ours, n_requests: int, new: int) -> tuple[float, float]:
    from qkv.generate import Engine, generate

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 4096, (16 + (48 * i) // max(n_requests - 1, 1),), generator=g).tolist()
               for i in range(n_requests)]
    kw = dict(max_new_tokens=new, min_new_tokens=new)
    t = time.process_time()
    alone = [generate(ours, torch.tensor([p]), **kw)[0, len(p):].tolist() for p in prompts]
    t_alone = time.process_time() - t
    engine = Engine(ours, block_size=16, max_batch_size=n_requests)
    t = time.process_time()
    ids = [engine.add_request(p, **kw) for p in prompts]
    out = engine.run()
    t_engine = time.process_time() - t
    assert [out[i] for i in ids] == alone, "the Engine's greedy tokens differ from generate()'s"
    total = n_requests * new
    return total / t_engine, total / t_alone


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--quick", action="store_true",
                    help="a 2-layer model, 3 requests of 4 tokens (smoke test)")
    a = ap.parse_args()
    if a.quick:
        a.requests, a.new = 3, 4
    torch.set_num_threads(a.threads)
    import transformers

    import qkv

    print("\n".join(pool_table()))
    hf = build(transformers, a.quick)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = qkv.from_pretrained(d)
    del hf
    engine, alone = engine_vs_generate(ours, a.requests, a.new)
    print(f"\ntorch {torch.__version__}, {a.threads} threads, {ours.num_parameters():,} parameters, "
          f"{a.requests} requests x {a.new} new tokens, greedy tokens equal")
    print("| decoding | tokens per CPU second |\n|---|---|")
    print(f"| Engine, paged latent cache, requests batched | {engine:.1f} |")
    print(f"| generate(), static latent cache, one request at a time | {alone:.1f} |")


if __name__ == "__main__":
    main()
