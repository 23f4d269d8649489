"""forward(last_only=True) (generation's prefill: the top block does the work of the last position only, its
keys and values still cover every position) computes the same last-position logits as the full forward, and
fills the KV cache with the same keys and values, for every norm x placement x position (incl. ALiBi's and
T5's query-dependent biases) x GQA variant, with left padding and per-row offsets; and for the decoder of an
encoder-decoder (cross-attention). float64, so the two must agree to ~1e-12, not to fp32 rounding. The fp32
comparison against transformers is in tests/interop (test_gpt2_parity.py, test_llama.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

import qkv

V = 13
NORMS = ("layernorm", "rmsnorm", "batchnorm")
PLACEMENTS = ("pre", "post")
POSITIONS = ("none", "learned", "rope", "alibi", "relative")
MATRIX = list(itertools.product(NORMS, PLACEMENTS, POSITIONS, (False, True)))
IDS = ["-".join((n, p, pos, "gqa" if g else "mha")) for n, p, pos, g in MATRIX]
TOL = dict(atol=1e-10, rtol=1e-10)


def _gpt(norm, placement, position, gqa, **kw):
    torch.manual_seed(0)
    m = qkv.build("gpt-nano", vocab_size=V, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2 if gqa else None,
                  context_length=24, position=position, placement=placement, norm=norm, ffn="swiglu", d_ff=48,
                  init_std=0.2, **kw)
    with torch.no_grad():  # non-trivial norm gains/biases and BatchNorm statistics (used in eval mode)
        for name, t in itertools.chain(m.named_parameters(), m.named_buffers()):
            if t.dim() == 1 and t.is_floating_point():
                t.copy_((0.5 if "var" in name else 0.0) + torch.rand_like(t) if "var" in name
                            or "weight" in name
                        else 0.3 * torch.randn_like(t))
    return m.double().eval()


@pytest.mark.parametrize("norm,placement,position,gqa", MATRIX, ids=IDS)
def test_last_only_equals_the_full_forward_and_fills_the_same_cache(norm, placement, position, gqa):
    m = _gpt(norm, placement, position, gqa)
    ids = torch.randint(0, V, (3, 9), generator=torch.Generator().manual_seed(1))
    keep = torch.ones(3, 9, dtype=torch.bool)
    keep[1, :4] = keep[2, :2] = False  # left padding, positions counted from each row's first real token
    offset = -(~keep).sum(1)
    with torch.no_grad():
        full_cache, last_cache = m.make_cache(3, 12), m.make_cache(3, 12)
        full = m(ids, attention_mask=keep, cache=full_cache, offset=offset)
        last = m(ids, attention_mask=keep, cache=last_cache, offset=offset, last_only=True)
        plain = m(ids, last_only=True)  # no mask, no cache: the causal case of the prefill benchmark
        ref = m(ids).logits[:, -1]
    assert last.logits.shape == (3, 1, V) and last.last_hidden_state.shape == (3, 1, 32)
    assert ref.std() > 0.1
    torch.testing.assert_close(last.logits[:, -1], full.logits[:, -1], **TOL)
    torch.testing.assert_close(plain.logits[:, -1], ref, **TOL)
    torch.testing.assert_close(last.last_hidden_state[:, -1], full.last_hidden_state[:, -1], **TOL)
    assert last_cache.length == full_cache.length == 9
    torch.testing.assert_close(last_cache.k, full_cache.k, **TOL)
    torch.testing.assert_close(last_cache.v, full_cache.v, **TOL)
    assert full_cache.k[:, :, :, :9].abs().sum() > 0


def test_last_only_with_attentions_keeps_every_position():
    m = _gpt("layernorm", "pre", "rope", False)
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = m(ids, last_only=True, return_attentions=True)
    assert out.last_hidden_state.shape == (2, 6, 32) and out.attentions[-1]["self"].shape == (2, 4, 6, 6)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_encdec_decode_last_only_equals_full(placement):
    torch.manual_seed(0)
    m = qkv.build("transformer-tiny", src_vocab_size=V, n_encoder_layers=2, n_decoder_layers=2, d_model=32,
                  n_heads=4, d_ff=48, n_kv_heads=2, context_length=24, placement=placement,
                  init_std=0.2).double().eval()
    src = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 0, 0]])
    src_mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])
    tgt = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        memory, _ = m.encode(src, src_mask)
        full, _ = m.decode(tgt, memory, memory_mask=src_mask)
        last, out = m.decode(tgt, memory, memory_mask=src_mask, last_only=True)
    assert out.hidden.shape == (2, 1, 32)
    torch.testing.assert_close(last[:, -1], full[:, -1], **TOL)


@pytest.mark.parametrize("norm,placement,position,gqa", MATRIX, ids=IDS)
def test_step_last_only_equals_the_full_step_and_fills_the_same_cache(norm, placement, position, gqa):
    """Stack.step(last_only=True) (model.step's route: a chunk of T tokens, the Engine's chunked prefill)
    gives the full step's last-token hidden state and the same cached keys/values, with left padding, per-row
    offsets and a key mask; on the paged cache too (its own keys/values layout), with rows of different
    lengths."""
    m = _gpt(norm, placement, position, gqa)
    ids = torch.randint(0, V, (3, 9), generator=torch.Generator().manual_seed(2))
    keep = torch.ones(3, 9, dtype=torch.bool)
    keep[1, :4] = keep[2, :2] = False
    offset = -(~keep).sum(1)
    with torch.no_grad():
        caches = [m.make_cache(3, 12), m.make_cache(3, 12)]
        for c in caches:  # the first 5 tokens cached, then a 4-token step
            m(ids[:, :5], attention_mask=keep[:, :5], cache=c, offset=offset)
        x = m.embed_target(ids[:, 5:])
        full = m.decoder.step(x, cache=caches[0], keep=keep, offset=offset + 5)
        last = m.decoder.step(x, cache=caches[1], keep=keep, offset=offset + 5, last_only=True)
        assert full.shape == (3, 4, 32) and last.shape == (3, 1, 32)
        torch.testing.assert_close(last[:, 0], full[:, -1], **TOL)
        torch.testing.assert_close(caches[1].k, caches[0].k, **TOL)
        torch.testing.assert_close(caches[1].v, caches[0].v, **TOL)
        # paged: two sequences of 5 and 2 cached tokens (the engine's per-row offsets and key mask)
        paged = [m.make_paged_cache(8, 4, max_batch_size=2), m.make_paged_cache(8, 4, max_batch_size=2)]
        for c in paged:
            c.k.zero_(), c.v.zero_()  # the pools are not zeroed (never-written slots hold anything)
            for sid, n in ((0, 5), (1, 2)):
                c.add_sequence(sid)
                c.set_active([sid])
                m.step(ids[sid:sid + 1, :n], c)
            c.set_active([0, 1])
        k2 = paged[0].keep_mask(3)
        x = m.embed_target(ids[:2, 5:8])
        full = m.decoder.step(x, cache=paged[0], keep=k2)
        last = m.decoder.step(x, cache=paged[1], keep=k2, last_only=True)
        torch.testing.assert_close(last[:, 0], full[:, -1], **TOL)
        torch.testing.assert_close(paged[1].k, paged[0].k, **TOL)
        torch.testing.assert_close(paged[1].v, paged[0].v, **TOL)
        assert paged[0].lens == paged[1].lens == {0: 8, 1: 5}
