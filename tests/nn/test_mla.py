"""Multi-head latent attention (nn/mla.py): the module against the formula written out head by head in
float64, the absorbed-weights decoding step against the full forward (one token, chunks, last_only, the
graph-capturable static step), generate() with the latent cache against uncached greedy decoding, the cache's
bytes per token against the formula beside MHA / GQA of the same width, and the config checks."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.config import ConfigError
from qkv.models.gpt import GPT, GPTConfig
from qkv.nn.mla import LatentCache, MLAConfig, MultiHeadLatentAttention, cache_bytes_per_token
from qkv.nn.position import RoPE

D, H = 32, 4
MLA = dict(kv_lora_rank=12, q_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)


def tiny(q_lora_rank: int | None = 10, **kw) -> GPT:
    torch.manual_seed(0)
    mla = MLAConfig(**{**MLA, "q_lora_rank": q_lora_rank})
    cfg = GPTConfig(vocab_size=50, n_layers=2, d_model=D, n_heads=H, context_length=64, ffn="swiglu",
                    norm="rmsnorm", position="rope", head_dim=mla.qk_rope_head_dim, bias=False,
                    tie_embeddings=False, mla=mla, **kw)
    model = GPT(cfg).double().eval()
    with torch.no_grad():  # the latent norms' gains away from 1, so a wrong norm shows
        for n, p in model.named_parameters():
            if n.endswith("_norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def reference(attn: MultiHeadLatentAttention, rope: RoPE, x: torch.Tensor) -> torch.Tensor:
    """Causal MLA, head by head and position by position, straight from the module docstring's formulas."""
    cfg, B, T, _ = attn.cfg, *x.shape
    rms = lambda v, g: v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + cfg.latent_norm_eps) * g  # noqa: E731
    if cfg.q_lora_rank is None:
        q = x @ attn.q_proj.weight.T
    else:
        q = rms(x @ attn.q_a_proj.weight.T, attn.q_a_norm.weight) @ attn.q_b_proj.weight.T
    q = q.view(B, T, H, -1)
    ckr = x @ attn.kv_a_proj.weight.T
    c, kr = rms(ckr[..., : cfg.kv_lora_rank], attn.kv_a_norm.weight), ckr[..., cfg.kv_lora_rank:]
    w = attn.kv_b_proj.weight.view(H, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    cos, sin = rope.cos[:T].double(), rope.sin[:T].double()
    rot = lambda v: v * cos + torch.cat([-v[..., v.shape[-1] // 2:], v[..., : v.shape[-1] // 2]], -1) * sin  # noqa
    out = torch.zeros(B, T, H, cfg.v_head_dim, dtype=x.dtype)
    for h in range(H):
        k = torch.cat([c @ w[h, : cfg.qk_nope_head_dim].T, rot(kr)], -1)  # (B, T, nope + rope)
        v = c @ w[h, cfg.qk_nope_head_dim:].T
        qh = torch.cat([q[:, :, h, : cfg.qk_nope_head_dim], rot(q[:, :, h, cfg.qk_nope_head_dim:])], -1)
        s = qh @ k.transpose(1, 2) / math.sqrt(qh.shape[-1])
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        out[:, :, h] = s.softmax(-1) @ v
    return out.reshape(B, T, -1) @ attn.out_proj.weight.T


@pytest.mark.parametrize("q_lora_rank", [10, None])
def test_forward_matches_the_formula(q_lora_rank):
    model = tiny(q_lora_rank)
    attn, rope = model.decoder.blocks[0].attn, model.decoder.position
    x = torch.randn(2, 7, D, dtype=torch.float64)
    y, _ = attn(x, position=rope)
    torch.testing.assert_close(y, reference(attn, rope, x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("q_lora_rank", [10, None])
def test_cached_step_equals_full_forward(q_lora_rank):
    model = tiny(q_lora_rank)
    ids = torch.randint(0, 50, (2, 12))
    full = model(ids).logits
    cache = model.make_cache(2, 16)
    assert isinstance(cache, LatentCache) and cache.k.shape == (2, 2, 1, 16, MLA["kv_lora_rank"])
    model.prefill(ids[:, :5], cache)
    got = [model.step(ids[:, 5:8], cache)]  # a chunk of 3 (last_only)
    got += [model.step(ids[:, t:t + 1], cache) for t in range(8, 12)]
    want = [full[:, 7]] + [full[:, t] for t in range(8, 12)]
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-10, atol=1e-10)
    # the whole chunk through Stack.step (every row's output) too
    cache2 = model.make_cache(2, 16)
    model.prefill(ids[:, :5], cache2)
    rows = model.decoder.step(model.tok_emb(ids[:, 5:9]), cache=cache2)
    torch.testing.assert_close(model.lm_head(rows), full[:, 5:9], rtol=1e-10, atol=1e-10)


def test_static_step_equals_step():
    model = tiny()
    ids = torch.randint(0, 50, (2, 6))
    a, b = model.make_cache(2, 10), model.make_cache(2, 10)
    model.prefill(ids[:, :5], a)
    model.prefill(ids[:, :5], b)
    want = model.step(ids[:, 5:6], a)
    got = model.static_step(ids[:, 5:6], b, index=torch.tensor([5]), offset=torch.tensor([5]))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_generate_with_the_latent_cache_is_greedy_decoding():
    model = tiny()
    ids = torch.randint(0, 50, (1, 5))
    out = model.generate(ids, max_new_tokens=10)
    seq = ids
    for _ in range(10):  # no cache: the full forward over the growing sequence
        seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], 1)
    assert out.tolist() == seq.tolist()
    beams = model.generate(ids, max_new_tokens=4, num_beams=2)  # beam search reorders the latent cache
    assert beams.shape == (1, 9)


def test_cache_bytes_per_token_against_the_formula():
    mla = tiny()
    L, r, dr = 2, MLA["kv_lora_rank"], MLA["qk_rope_head_dim"]
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        assert cache_bytes_per_token(mla.make_cache(3, 8, dtype=dtype)) == L * (r + dr) * size
        for n_kv in (H, 2, 1):  # MHA, GQA, MQA of the same width: 2 (K and V) * n_kv * head_dim per layer
            cfg = GPTConfig(vocab_size=50, n_layers=L, d_model=D, n_heads=H, n_kv_heads=n_kv, position="rope")
            other = GPT(cfg).make_cache(3, 8, dtype=dtype)
            assert cache_bytes_per_token(other) == L * 2 * n_kv * (D // H) * size


def test_the_paged_cache_holds_latents_and_other_caches_are_refused():
    from qkv.generate.engine import Engine
    from qkv.nn.paged import PagedKVCache
    from qkv.nn.paged_latent import PagedLatentCache

    model = tiny()
    assert isinstance(model.make_paged_cache(4), PagedLatentCache)
    assert isinstance(Engine(model, num_blocks=4).cache, PagedLatentCache)
    with pytest.raises(TypeError, match="LatentCache"):
        model.step(torch.zeros(1, 1, dtype=torch.long), super(GPT, model).make_cache(1, 4))  # per-head K/V
    per_head = PagedKVCache(2, 1, 4, 4, 4, dtype=torch.float64)
    per_head.add_sequence(0)
    per_head.set_active([0])
    with pytest.raises(TypeError, match="PagedLatentCache"):
        model.step(torch.zeros(1, 1, dtype=torch.long), per_head)


@pytest.mark.parametrize("change, match", [
    ({"position": "learned"}, "position=rope"),
    ({"head_dim": 8}, "head_dim=4"),
    ({"n_kv_heads": 2}, "n_kv_heads"),
    ({"mla": MLAConfig(**{**MLA, "kv_lora_rank": -1})}, "kv_lora_rank"),
    ({"mla": MLAConfig(**{**MLA, "q_lora_rank": 0})}, "q_lora_rank"),
    ({"mla": MLAConfig(**{**MLA, "v_head_dim": 0})}, "v_head_dim"),
])
def test_config_errors(change, match):
    kw = dict(vocab_size=50, n_layers=2, d_model=D, n_heads=H, position="rope", head_dim=4,
              mla=MLAConfig(**MLA))
    with pytest.raises(ConfigError, match=match):
        GPT(GPTConfig(**{**kw, **change}))


@pytest.mark.filterwarnings("ignore:.*the int4 kernel needs")
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_decodes(mode):
    """--quantize swaps kv_b_proj too: the absorbed step reads its weight back from the quantized layer."""
    from qkv.nn.quant import Int4WeightOnlyLinear, Int8WeightOnlyLinear, quantize_model

    torch.manual_seed(0)
    mla = MLAConfig(kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10)
    cfg = GPTConfig(vocab_size=50, n_layers=2, d_model=D, n_heads=H, ffn="swiglu", norm="rmsnorm",
                    position="rope", head_dim=4, bias=False, mla=mla)
    q = quantize_model(GPT(cfg).eval(), mode, group_size=32)
    kind = Int4WeightOnlyLinear if mode == "int4" else Int8WeightOnlyLinear
    assert isinstance(q.decoder.blocks[0].attn.kv_b_proj, kind)
    ids = torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        full = q(ids).logits[:, -1]
        cache = q.make_cache(1, 8)
        q.prefill(ids[:, :5], cache)
        step = q.step(ids[:, 5:], cache)
    tol = 2e-3  # both kernels take bf16 activations on a CPU, so the two paths round differently (1e-3)
    torch.testing.assert_close(step, full, rtol=tol, atol=tol)


def test_left_padded_batch_generates_each_row_as_alone():
    """Per-row positions (a tensor offset through RoPE) and the key mask reach the latent attention."""
    model = tiny()
    a, b = torch.randint(3, 50, (1, 7)), torch.randint(3, 50, (1, 4))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    both = model.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    assert both[0, 7:].tolist() == model.generate(a, max_new_tokens=6)[0, 7:].tolist()
    assert both[1, 7:].tolist() == model.generate(b, max_new_tokens=6)[0, 4:].tolist()


def test_graph_captured_generation_equals_eager():
    """generate(compile=...) runs Stack.static_step over the LatentCache (columns written at a device index);
    the "eager" backend traces the same graph without Inductor's compile time (True, Inductor: also equal,
    ~45 s)."""
    model = tiny().float()
    ids = torch.randint(0, 50, (1, 5))
    want = model.generate(ids, max_new_tokens=8)
    assert model.generate(ids, max_new_tokens=8, compile="eager").tolist() == want.tolist()


def test_training_reaches_every_mla_weight():
    model = tiny().train()
    ids = torch.randint(0, 50, (2, 9))
    model(ids, labels=ids).loss.backward()
    attn = model.decoder.blocks[0].attn
    for name, p in attn.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
