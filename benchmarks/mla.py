"""Multi-head latent attention: the cache it holds, and a small DeepSeek-V3 decoding beside transformers.

  cache    bytes per cached token (all layers, bf16) of DeepSeek-V3's shape (61 layers; MLA caches the
           512-wide latent and the 64-wide rotary key) against multi-head / grouped-query / multi-query
           attention with 128-wide heads, computed from the caches qkv allocates
           (qkv.nn.mla.cache_bytes_per_token)
  decode   a random DeepseekV3ForCausalLM (4 layers, hidden 256, 16 heads, kv_lora_rank 128, q_lora_rank 96,
           nope/rope/v 32/16/32, 8 experts of 256 top-2 in 2 groups, first layer dense, vocab 4096) saved by
           transformers and loaded by both: greedy, prompt 32, --new tokens, batch 1, tokens per CPU second
  step     one decoding step of that model at a cache of N tokens: qkv's absorbed-weights step (model.step,
           attention over the cached latent) against its forward with the cache (keys and values up-projected
           from every cached latent), CPU ms

Measured as CPU time of this process (time.process_time, medians of --repeats), one thread by default: on a
shared machine wall time mostly measures the other processes.

    .venv/bin/python benchmarks/mla.py [--quick] [--threads 1] [--new 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def timed(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        out.append(time.process_time() - t)
    return statistics.median(out)


def cache_table() -> list[str]:
    from qkv.nn.cache import StaticCache
    from qkv.nn.mla import LatentCache, cache_bytes_per_token

    L, bf = 61, torch.bfloat16
    rows = [("MLA, latent 512 + rotary key 64 (DeepSeek-V3)", LatentCache(L, 1, 512, 64, 1, dtype=bf)),
            ("MHA, 128 heads x 128", StaticCache(L, 1, 128, 128, 1, dtype=bf)),
            ("GQA, 8 key/value heads x 128", StaticCache(L, 1, 8, 128, 1, dtype=bf)),
            ("MQA, 1 key/value head x 128", StaticCache(L, 1, 1, 128, 1, dtype=bf))]
    mla = cache_bytes_per_token(rows[0][1])
    out = ["| attention | numbers per token and layer | bytes per token (61 layers, bf16) | GiB at 32K "
           "tokens | x MLA |", "|---|---|---|---|---|"]
    for name, cache in rows:
        n = cache_bytes_per_token(cache)
        out.append(f"| {name} | {n // L // 2:,} | {n:,} | {n * 32768 / 2**30:.2f} | {n / mla:.1f} |")
    return out


def build(transformers, quick: bool):
    # quick: latents narrower than the 64-wide model (qkv refuses a latent wider than what it compresses)
    cfg = transformers.DeepseekV3Config(
        vocab_size=4096, hidden_size=256 if not quick else 64, intermediate_size=512,
        moe_intermediate_size=256,
        num_hidden_layers=4 if not quick else 2, num_attention_heads=16, num_key_value_heads=16,
        n_shared_experts=1,
        n_routed_experts=8, kv_lora_rank=128 if not quick else 48, q_lora_rank=96 if not quick else 48,
        qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=4096)
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(cfg).eval()


def step_times(ours, lengths: list[int], repeats: int) -> list[tuple[int, float, float]]:
    out = []
    for n in lengths:
        ids = torch.randint(3, 4096, (1, n))
        tok = ids[:, -1:]
        absorbed, expanded = ours.make_cache(1, n + 2 * repeats + 2), ours.make_cache(1, n + 2 * repeats + 2)
        ours.prefill(ids, absorbed)
        ours.prefill(ids, expanded)
        a = timed(lambda: ours.step(tok, absorbed), repeats)  # noqa: B023 (called before the loop moves on)
        e = timed(lambda: ours(tok, cache=expanded, last_only=True), repeats)  # noqa: B023
        out.append((n, a * 1e3, e * 1e3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="a 2-layer model, 8 tokens, one round (a smoke test)")
    a = ap.parse_args()
    if a.quick:
        a.new, a.repeats = 8, 1
    torch.set_num_threads(a.threads)
    import transformers

    import qkv
    from qkv.generate import generate

    print("\n".join(cache_table()))
    hf = build(transformers, a.quick)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = qkv.from_pretrained(d)
    prompt = torch.randint(3, 4096, (1, 32))
    kw = dict(max_new_tokens=a.new, min_new_tokens=a.new)
    with torch.no_grad():
        hf_gen = timed(lambda: hf.generate(prompt, attention_mask=torch.ones_like(prompt),
                                           do_sample=False, **kw),
                       a.repeats)
        our_gen = timed(lambda: generate(ours, prompt, **kw), a.repeats)
        steps = step_times(ours, [64] if a.quick else [256, 2048], max(a.repeats, 5))
    print(f"\ntorch {torch.__version__}, transformers {transformers.__version__}, {a.threads} threads, "
          f"{ours.num_parameters():,} parameters")
    print("| measure | qkv | transformers |\n|---|---|---|")
    print(f"| greedy decoding, batch 1, tokens per CPU second | {a.new / our_gen:.1f} "
          f"| {a.new / hf_gen:.1f} |")
    print("\n| cached tokens | absorbed step, CPU ms | up-projecting forward, CPU ms |\n|---|---|---|")
    for n, x, y in steps:
        print(f"| {n} | {x:.2f} | {y:.2f} |")


if __name__ == "__main__":
    main()
