"""The decoding step (Stack.step: Block.step -> MultiHeadAttention.step / FeedForward.step / Linear.step)
computes the same function as the full forward pass, for every variant on the shared blocks:
activation (4) x norm (3) x placement (2) x position (5) x GQA (2) = 240 variants, for a decoder-only GPT
and an encoder-decoder (cross-attention K/V read from the cache), on the StaticCache and the paged cache.

Reference: the full forward pass over the whole prefix, no cache, recomputed at every step. The prompts are
left-padded (per-row offsets and key masks) so padding, masks and positions are exercised as in generate().
The models run in float64, so the two paths must agree to ~1e-12, not merely to fp32 rounding (with large
random weights fp32 logits of magnitude ~50 differ by ~5e-5 between any two summation orders); the fp32
path is compared in tests/generate/test_search.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.nn import ffn as ffn_module
from qkv.nn.attention import MultiHeadAttention
from qkv.nn.norm import LayerNorm
from qkv.nn.paged import PagedKVCache

ACTS = ("relu", "gelu", "gelu_tanh", "swiglu")
NORMS = ("layernorm", "rmsnorm", "batchnorm")
PLACEMENTS = ("pre", "post")
POSITIONS = ("none", "sinusoidal", "learned", "rope", "alibi")
MATRIX = list(itertools.product(ACTS, NORMS, PLACEMENTS, POSITIONS, (False, True)))
IDS = ["-".join((a, n, p, pos, "gqa" if g else "mha")) for a, n, p, pos, g in MATRIX]
V = 13


def _randomise_norms(model: torch.nn.Module) -> None:
    """Non-trivial gains, biases and BatchNorm running statistics (eval mode uses them)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("running_mean"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.3)
            elif name.endswith("running_var"):
                buf.copy_(torch.rand(buf.shape, generator=g) + 0.5)
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if name.endswith("weight")
                        else 0.3 * torch.randn(p.shape, generator=g))


def gpt(act, norm, placement, position, gqa, **kw):
    m = qkv.build("gpt-nano", vocab_size=V, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2 if gqa else None,
                  context_length=24, position=position, placement=placement, norm=norm, ffn=act, d_ff=48,
                  init_std=0.2, **kw)
    _randomise_norms(m)
    return m.double().eval()


def encdec(act, norm, placement, position, gqa, **kw):
    m = qkv.build("transformer-tiny", src_vocab_size=V, n_encoder_layers=2, n_decoder_layers=2, d_model=32,
                  n_heads=4, d_ff=48, n_kv_heads=2 if gqa else None, context_length=24, position=position,
                  placement=placement, norm=norm, ffn=act, init_std=0.2, **kw)
    _randomise_norms(m)
    return m.double().eval()


TOL = dict(atol=1e-9, rtol=1e-9)


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(map(len, rows))
    ids = torch.tensor([[0] * (T - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows], dtype=torch.bool)
    return ids, mask


def check_gpt_steps(m, cache, ids, mask, n_pad, steps=4, chunk=1):
    """Prefill with forward(), then `steps` decoding steps of `chunk` tokens with model.step(), each
    compared with the full forward pass over the whole sequence."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        m(ids, attention_mask=mask, cache=cache, offset=-n_pad)
        seq, keep = ids, mask
        for _ in range(steps):
            new = torch.randint(0, V, (ids.shape[0], chunk), generator=g)
            seq = torch.cat([seq, new], 1)
            keep = torch.cat([keep, torch.ones(ids.shape[0], chunk, dtype=torch.bool)], 1)
            got = m.step(new, cache, keep=keep, offset=cache.length - n_pad)
            full = m(seq, attention_mask=keep, offset=-n_pad).logits[:, -1]
            torch.testing.assert_close(got, full, **TOL)


@pytest.mark.parametrize("act,norm,placement,position,gqa", MATRIX, ids=IDS)
def test_gpt_step_equals_forward_on_static_and_paged_caches(act, norm, placement, position, gqa):
    m = gpt(act, norm, placement, position, gqa)
    ids, mask = left_pad([[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]])
    n_pad = (~mask).sum(1)
    check_gpt_steps(m, m.make_cache(3, 12), ids, mask, n_pad)
    # the paged cache: three sequences of different lengths, each prefilled alone, then decoded as one batch
    # with per-row offsets and key masks (block size 3: tables span several blocks)
    paged = m.make_paged_cache(num_blocks=24, block_size=3)
    rows = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    with torch.no_grad():
        for i, r in enumerate(rows):
            paged.add_sequence(i)
            paged.set_active([i])
            m.prefill(torch.tensor([r]), paged)
        seqs = [torch.tensor([r]) for r in rows]
        g = torch.Generator().manual_seed(2)
        for _ in range(4):
            paged.set_active([0, 1, 2])
            new = torch.randint(0, V, (3, 1), generator=g)
            got = m.step(new, paged, keep=paged.keep_mask(1))
            for i in range(3):
                seqs[i] = torch.cat([seqs[i], new[i:i + 1]], 1)
                torch.testing.assert_close(got[i], m(seqs[i]).logits[0, -1], **TOL)


@pytest.mark.parametrize("act,norm,placement,position,gqa", MATRIX, ids=IDS)
def test_encdec_step_equals_forward(act, norm, placement, position, gqa):
    """Cross-attention reads the encoder K/V and the source mask from the cache; the source is padded."""
    m = encdec(act, norm, placement, position, gqa)
    src = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 0, 0]])
    src_mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])
    tgt = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        source = m.encode_source(src, src_mask)
        cache = m.make_cache(2, 8)
        m.prefill(tgt[:, :2], cache, source=source)
        full = m(src, decoder_input_ids=tgt, attention_mask=src_mask).logits
        for t in range(2, 7):
            got = m.step(tgt[:, t:t + 1], cache)
            torch.testing.assert_close(got, full[:, t], **TOL)


@pytest.mark.parametrize("position", POSITIONS)
def test_encdec_step_on_the_paged_cache(position):
    m = encdec("swiglu", "rmsnorm", "pre", position, True)
    src = torch.tensor([[3, 4, 5, 6], [8, 9, 0, 0]])
    src_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    tgt = torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        paged = m.make_paged_cache(num_blocks=8, block_size=2)
        for i in range(2):
            paged.add_sequence(i)
        paged.set_active([0, 1])
        m.prefill(tgt[:, :1], paged, source=m.encode_source(src, src_mask))
        full = m(src, decoder_input_ids=tgt, attention_mask=src_mask).logits
        for t in range(1, 6):
            got = m.step(tgt[:, t:t + 1], paged, keep=paged.keep_mask(1))
            torch.testing.assert_close(got, full[:, t], **TOL)


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("chunk", [2, 3])
def test_small_chunk_steps_equal_forward(position, chunk):
    """A step of several new tokens (the causal mask among them is part of the step's additive term)."""
    m = gpt("gelu_tanh", "layernorm", "pre", position, True)
    ids, mask = left_pad([[1, 2, 3], [4, 5, 6, 7, 8]])
    n_pad = (~mask).sum(1)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        cache = m.make_cache(2, 5 + 3 * chunk)
        m(ids, attention_mask=mask, cache=cache, offset=-n_pad)
        seq, keep = ids, mask
        for _ in range(3):
            new = torch.randint(0, V, (2, chunk), generator=g)
            seq = torch.cat([seq, new], 1)
            keep = torch.cat([keep, torch.ones(2, chunk, dtype=torch.bool)], 1)
            h = m.decoder.step(m.embed_target(new), cache=cache, keep=keep, offset=cache.length - n_pad)
            got = m.lm_head(h)  # every new position, not only the last
            full = m(seq, attention_mask=keep, offset=-n_pad).logits[:, -chunk:]
            torch.testing.assert_close(got, full, **TOL)


def test_whisper_step_equals_forward():
    m = qkv.build("whisper-digits", init_std=0.2).double().eval()
    audio = torch.randn(2, 8000, dtype=torch.float64) * 0.1
    tgt = torch.randint(3, 16, (2, 6), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        cache = m.make_cache(2, 8)
        m.prefill(tgt[:, :1], cache, source=m.encode_source(audio))
        full = m(audio, decoder_input_ids=tgt).logits
        for t in range(1, 6):
            torch.testing.assert_close(m.step(tgt[:, t:t + 1], cache), full[:, t], **TOL)


# -- a variant the step does not special-case works in both paths ----------------------------------------
def test_a_new_activation_is_one_table_entry(monkeypatch):
    """nn/ffn.py's ACTIVATIONS is the only place an activation lives: one entry (here gated GELU, T5's
    'gated-gelu') is accepted by the config and computed identically by the forward pass and the decoding
    step."""
    monkeypatch.setitem(ffn_module.ACTIVATIONS, "geglu", ffn_module.Activation(F.gelu, True))
    m = gpt("geglu", "layernorm", "pre", "rope", True)
    assert m.decoder.blocks[0].ffn.gate is not None
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    f = m.decoder.blocks[0].ffn
    want = F.linear(F.gelu(F.linear(x, f.gate.weight, f.gate.bias)) * F.linear(x, f.up.weight, f.up.bias),
                    f.down.weight, f.down.bias)
    torch.testing.assert_close(f(x), want)
    ids, mask = left_pad([[1, 2, 3], [4, 5]])
    check_gpt_steps(m, m.make_cache(2, 10), ids, mask, (~mask).sum(1))


class ScaleNorm(torch.nn.Module):
    """A norm the library does not ship (Nguyen & Salazar 2019): g * x / ||x||. It takes (x, keep) like
    every qkv norm."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.g = torch.nn.Parameter(torch.tensor(d**0.5))

    def forward(self, x, keep=None):
        return self.g * x / x.norm(dim=-1, keepdim=True).clamp_min(1e-5)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_an_unknown_norm_module_is_called_by_the_step(placement):
    m = gpt("gelu", "layernorm", placement, "alibi", False)
    for block in m.decoder.blocks:
        block.norm1, block.norm2 = ScaleNorm(32), ScaleNorm(32)
        assert not isinstance(block.norm1, LayerNorm)
    ids, mask = left_pad([[1, 2, 3, 4], [5, 6]])
    check_gpt_steps(m, m.make_cache(2, 10), ids, mask, (~mask).sum(1))


def test_step_refuses_training_mode_and_an_empty_cross_cache():
    m = gpt("gelu", "layernorm", "pre", "rope", False).train()
    with pytest.raises(RuntimeError, match="eval"):
        m.step(torch.tensor([[1]]), m.make_cache(1, 4))
    attn = MultiHeadAttention(16, 2, cross=True).eval()
    with pytest.raises(ValueError, match="prefill"):
        attn.step(torch.randn(1, 16), batch=1, cache=PagedKVCache(1, 2, 8, 4, 2), layer=0)
