"""Multi-head latent attention in the paged KV cache (nn/paged_latent.py) and the continuous-batching Engine:
a random DeepSeek-V3 folder (transformers' DeepseekV3ForCausalLM, built and saved here) served by the Engine
gives transformers' greedy tokens and qkv's static-cache generate() for prompts of several lengths batched
together over small blocks (chunked prefill, prefix-cache hits, copy-on-write, preemption); the paged step's
logits against the full forward in float64; the cache's bytes per token against the formula."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.generate import Engine, generate
from qkv.nn.mla import cache_bytes_per_token
from qkv.nn.paged_latent import PagedLatentCache

transformers = pytest.importorskip("transformers")

HF = dict(vocab_size=200, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
          num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=6,
          routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
          qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
          norm_topk_prob=True, max_position_embeddings=128, initializer_range=0.2, tie_word_embeddings=False,
          bos_token_id=1, eos_token_id=2)
LENGTHS = (3, 11, 6, 17, 1, 9)
NEW = 10


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers model, qkv model) of one random DeepSeek-V3 folder."""
    folder = tmp_path_factory.mktemp("deepseek")
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF)).eval()
    with torch.no_grad():  # norms away from 1 and a nonzero selection bias, so a wrong use of either shows
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    hf.save_pretrained(folder)
    return hf, qkv.from_pretrained(folder)


def prompts(seed: int = 1, lengths=LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, HF["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def transformers_greedy(hf, prompt: list[int], n: int = NEW) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False)
    return out[0, len(prompt):].tolist()


def static_greedy(model, prompt: list[int], n: int = NEW) -> list[int]:
    out = generate(model, torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def serve(engine: Engine, batch: list[list[int]], n: int = NEW) -> list[list[int]]:
    ids = [engine.add_request(p, max_new_tokens=n, min_new_tokens=n) for p in batch]
    out = engine.run()
    return [out[i] for i in ids]


@pytest.mark.parametrize("prefill_chunk", [None, 5])
def test_engine_greedy_equals_transformers_and_static_generate(pair, prefill_chunk):
    hf, ours = pair
    batch = prompts()
    engine = Engine(ours, block_size=4, max_batch_size=4, prefill_chunk=prefill_chunk)
    assert isinstance(engine.cache, PagedLatentCache)
    got = serve(engine, batch)
    for prompt, tokens in zip(batch, got):
        assert tokens == transformers_greedy(hf, prompt) == static_greedy(ours, prompt)
    assert engine.cache.blocks_in_use == 0  # every block went back to the pool


def test_prefix_cache_hits_and_copy_on_write_give_the_same_tokens(pair):
    _, ours = pair
    system = prompts(2, (13,))[0]  # three full blocks of 4 and one token more
    batch = [system + tail for tail in prompts(3, (2, 5, 7))]
    engine = Engine(ours, block_size=4, max_batch_size=4)
    first = serve(engine, batch[:1])
    rest = serve(engine, batch[1:] + [batch[0][:12]])  # the last: a prompt of cached blocks only
    stats = engine.stats()
    assert stats["prefix_hit_tokens"] >= 3 * 12 - 1 and stats["cow_copies"] >= 1
    want = [static_greedy(ours, p) for p in batch + [batch[0][:12]]]
    assert first + rest == want


def test_preemption_recomputes_the_same_tokens(pair):
    _, ours = pair
    batch = prompts(4, (9, 14, 5, 12))
    engine = Engine(ours, block_size=4, num_blocks=12, max_batch_size=4)
    got = serve(engine, batch, 12)
    assert engine.stats()["preemptions"] > 0
    assert got == [static_greedy(ours, p, 12) for p in batch]


def test_paged_step_logits_equal_the_full_forward_in_float64(pair):
    """Rows of different cached lengths in one step (right-aligned gather, keep mask, per-row positions)."""
    _, ours = pair
    model = ours.double()
    try:
        batch = prompts(5, (5, 10, 2))
        cache = model.make_paged_cache(16, 3)
        for i, p in enumerate(batch):  # each prompt prefilled alone, then one step for all of them together
            cache.add_sequence(i)
            cache.set_active([i])
            model.step(torch.tensor([p[:-1]]), cache)
        cache.set_active([0, 1, 2])
        last = torch.tensor([[p[-1]] for p in batch])
        got = model.step(last, cache, keep=cache.keep_mask(1))
        want = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in batch])
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    finally:
        ours.float()


def test_cache_bytes_per_token(pair):
    _, ours = pair
    L, r, rope = HF["num_hidden_layers"], HF["kv_lora_rank"], HF["qk_rope_head_dim"]
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        paged = ours.make_paged_cache(8, 4, dtype=dtype)
        assert paged.bytes_per_token == (r + rope) * size * L == paged.bytes_per_block // 4
        assert paged.bytes_per_token == cache_bytes_per_token(ours.make_cache(1, 8, dtype=dtype))
        assert paged.k.nbytes + paged.v.nbytes == 8 * paged.bytes_per_block  # what the pool really holds
