"""KV-cache exactness for every decoder variant: position encoding x attention backend x GQA on/off x
GPT / encoder-decoder. Reference: the full forward pass recomputed over the whole prefix at every step."""

from __future__ import annotations

import itertools

import pytest
import torch
from _genmodels import BACKENDS, POSITIONS, tiny_encdec, tiny_gpt

from qkv.generate import PagedKVCache, generate

MATRIX = list(itertools.product(POSITIONS, BACKENDS, (False, True)))
IDS = [f"{p}-{b}-{'gqa' if g else 'mha'}" for p, b, g in MATRIX]


@pytest.mark.parametrize("position,backend,gqa", MATRIX, ids=IDS)
@torch.no_grad()
def test_gpt_cached_logits_equal_full_recompute(position, backend, gqa):
    m = tiny_gpt(position, backend, gqa)
    seq = torch.randint(0, 11, (2, 14))
    cache = m.make_cache(2, 14)
    prefill = 5
    got = [m(seq[:, :prefill], cache=cache).logits]  # (B, 5, V): every prefill position
    for t in range(prefill, seq.shape[1]):
        got.append(m(seq[:, t : t + 1], cache=cache).logits)
    got = torch.cat(got, dim=1)
    for t in range(1, seq.shape[1] + 1):
        full = m(seq[:, :t]).logits[:, -1]
        torch.testing.assert_close(got[:, t - 1], full, atol=1e-5, rtol=1e-5)
    assert cache.k.shape[2] == (2 if gqa else 4)  # only the kv heads are stored


@pytest.mark.parametrize("position,backend,gqa", MATRIX, ids=IDS)
@torch.no_grad()
def test_encdec_cached_logits_equal_full_recompute(position, backend, gqa):
    m = tiny_encdec(position, backend, gqa)
    src = torch.randint(3, 11, (2, 7))
    src_mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    tgt = torch.randint(3, 11, (2, 9))
    memory, _ = m.encode(src, src_mask)
    cache = m.make_cache(2, 9)
    got = [m.decode(tgt[:, :3], memory, memory_mask=src_mask, cache=cache)[0]]
    for t in range(3, tgt.shape[1]):
        got.append(m.decode(tgt[:, t : t + 1], memory, memory_mask=src_mask, cache=cache)[0])
    got = torch.cat(got, dim=1)
    full = m(src, decoder_input_ids=tgt, attention_mask=src_mask).logits  # causal: row t sees tgt[:t+1]
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("position,backend,gqa", MATRIX, ids=IDS)
def test_greedy_tokens_identical_with_and_without_cache(position, backend, gqa):
    g = tiny_gpt(position, backend, gqa)
    x = torch.randint(0, 11, (2, 4))
    a, b = generate(g, x, 12), generate(g, x, 12, use_cache=False)
    assert torch.equal(a, b)
    assert len(set(a[:, 4:].flatten().tolist())) > 1  # not a degenerate constant continuation
    e = tiny_encdec(position, backend, gqa)
    src = torch.randint(3, 11, (2, 6))
    assert torch.equal(generate(e, src, 10), generate(e, src, 10, use_cache=False))


@pytest.mark.parametrize("position,backend,gqa", MATRIX, ids=IDS)
@torch.no_grad()
def test_paged_cache_equals_static_cache(position, backend, gqa):
    """Three sequences of different lengths share one paged pool (block size 3, so tables span several
    blocks) and decode as one batch; each must match its own static-cache run."""
    m = tiny_gpt(position, backend, gqa)
    c = m.config
    lens = [2, 7, 4]
    seqs = [torch.randint(0, 11, (1, n + 6)) for n in lens]
    paged = PagedKVCache(c.n_layers, c.n_kv_heads or c.n_heads, c.d_model // c.n_heads, num_blocks=20,
                         block_size=3)
    for i, (s, n) in enumerate(zip(seqs, lens)):  # prefill each alone
        paged.add_sequence(i)
        paged.set_active([i])
        m(s[:, :n], cache=paged)
    statics = []
    for s, n in zip(seqs, lens):
        sc = m.make_cache(1, n + 6)
        m(s[:, :n], cache=sc)
        statics.append(sc)
    for step in range(6):  # batched decoding over sequences of different lengths
        paged.set_active([0, 1, 2])
        ids = torch.cat([s[:, n + step : n + step + 1] for s, n in zip(seqs, lens)])
        got = m(ids, attention_mask=paged.keep_mask(1), cache=paged).logits[:, -1]
        for i, (s, n) in enumerate(zip(seqs, lens)):
            ref = m(s[:, n + step : n + step + 1], cache=statics[i]).logits[:, -1]
            torch.testing.assert_close(got[i : i + 1], ref, atol=1e-5, rtol=1e-5)
    for i, n in enumerate(lens):  # lazily allocated: at most one partly filled block per sequence
        assert len(paged.tables[i]) == -(-(n + 6) // 3)
