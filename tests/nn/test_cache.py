"""StaticCache.reorder (beam search): the filled positions are gathered in place, the same values as
index_select over the whole buffer; cross=False keeps the encoder K/V and mask, a new batch size
reallocates."""

from __future__ import annotations

import torch

from qkv.nn.cache import StaticCache


def _filled(cache: StaticCache, batch: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    ks, vs = [], []
    for layer in range(2):
        k, v = torch.randn(batch, 2, n, 4), torch.randn(batch, 2, n, 4)
        cache.update(layer, k, v)
        ks.append(k), vs.append(v)
    cache.advance(n)
    return torch.stack(ks), torch.stack(vs)


def test_reorder_gathers_filled_rows_and_keeps_cross_when_asked():
    torch.manual_seed(0)
    cache = StaticCache(2, 4, 2, 4, max_len=7)
    k, v = _filled(cache, 4, 3)
    mem_k, mem_v = torch.randn(4, 2, 5, 4), torch.randn(4, 2, 5, 4)
    cache.set_cross(0, mem_k, mem_v)
    cache.memory_keep = torch.tensor([[1, 1, 1, 0, 0]] * 4).bool()
    index = torch.tensor([1, 1, 3, 0])
    cache.reorder(index, cross=False)
    assert cache.get_cross(0)[0] is mem_k and cache.get_cross(0)[1] is mem_v
    kl, vl = cache.update(1, torch.zeros(4, 2, 1, 4), torch.zeros(4, 2, 1, 4))  # a step reads what was kept
    torch.testing.assert_close(kl[:, :, :3], k[1].index_select(0, index), rtol=0, atol=0)
    torch.testing.assert_close(vl[:, :, :3], v[1].index_select(0, index), rtol=0, atol=0)
    torch.testing.assert_close(cache.k[0, :, :, :3], k[0].index_select(0, index), rtol=0, atol=0)
    cache.reorder(index)  # cross=True (the default): the encoder K/V follow the rows too
    torch.testing.assert_close(cache.get_cross(0)[0], mem_k.index_select(0, index), rtol=0, atol=0)


def test_reorder_to_another_batch_size_reallocates():
    cache = StaticCache(2, 2, 2, 4, max_len=5)
    k, _ = _filled(cache, 2, 2)
    cache.reorder(torch.tensor([0, 0, 1, 1, 1]))
    assert cache.k.shape[1] == 5
    kl, _ = cache.update(0, torch.zeros(5, 2, 1, 4), torch.zeros(5, 2, 1, 4))
    torch.testing.assert_close(kl[:, :, :2], k[0].index_select(0, torch.tensor([0, 0, 1, 1, 1])), rtol=0,
                               atol=0)


def test_paged_step_update_reads_keys_and_values_from_the_pool_like_the_gathered_path():
    """The paged cache's decoding step leaves the keys and values in the pool: PoolKeys.scores(q) equals q @
    K^T over update()'s gathered keys, and PoolRows.weighted_sum(probs) equals probs @ the gathered values, in
    float64, on two layers and two steps, for grouped queries (3 query heads per key/value head), rows of
    different lengths (masked columns), partial last blocks, a block boundary crossed by the step, prefix
    blocks shared by two sequences and a copy-on-write of a shared block. update()'s gathered keys are checked
    against the keys that were written (the key pool is stored block-transposed)."""
    from qkv.nn.paged import PagedKVCache, PoolKeys, PoolRows

    torch.manual_seed(0)
    L, H, hd, G, bs = 2, 2, 8, 3, 4
    dt = torch.float64
    caches = [PagedKVCache(L, H, hd, num_blocks=40, block_size=bs, dtype=dt) for _ in range(2)]
    written: dict[int, list[torch.Tensor]] = {}  # sequence -> per layer (H, n, hd) keys written so far

    def fill(c, s, k, v):
        c.set_active([s])
        for layer in range(L):
            c.update(layer, k[layer], v[layer])
        c.advance(k.shape[3])

    def rand(n):
        return torch.randn(L, 1, H, n, hd, dtype=dt), torch.randn(L, 1, H, n, hd, dtype=dt)

    plain = {0: rand(5), 3: rand(8), 2: rand(1)}
    tail1 = rand(7)
    for c in caches:
        for s, (k, v) in plain.items():
            c.add_sequence(s)
            fill(c, s, k, v)
        c.add_sequence(1, shared=c.tables[0][:1])  # shares sequence 0's first (full) block, then 7 more
        fill(c, 1, *tail1)
        # sequence 3's two full blocks; the step rewrites position 7
        c.add_sequence(4, shared=c.tables[3][:2])
        c.set_length(4, 7)
    for s, (k, _) in plain.items():
        written[s] = [k[layer, 0] for layer in range(L)]
    written[1] = [torch.cat([plain[0][0][layer, 0, :, :4], tail1[0][layer, 0]], 1) for layer in range(L)]
    written[4] = [plain[3][0][layer, 0, :, :7] for layer in range(L)]
    order = [0, 1, 2, 3, 4]
    assert caches[1].tables[1][0] == caches[1].tables[0][0]  # shared before the step
    B = len(order)
    for _ in range(2):
        for c in caches:
            c.set_active(order)
        keep = caches[1].keep_mask(1).repeat_interleave(H, 0).unsqueeze(1)  # (B * H, 1, tk)
        for layer in range(L):
            k1, v1 = torch.randn(B, H, 1, hd, dtype=dt), torch.randn(B, H, 1, hd, dtype=dt)
            for i, s in enumerate(order):
                written[s][layer] = torch.cat([written[s][layer], k1[i]], 1)
            kr, vr = caches[0].update(layer, k1, v1)
            ks, vs = caches[1].step_update(layer, k1, v1)
            assert isinstance(ks, PoolKeys) and isinstance(vs, PoolRows)
            tk = kr.shape[2]
            for i, s in enumerate(order):  # the gathered keys: the written ones, right-aligned
                n = written[s][layer].shape[1]
                assert torch.equal(kr[i, :, tk - n:], written[s][layer])
            q = torch.randn(B * H, G, hd, dtype=dt)
            want = q @ kr.reshape(B * H, tk, hd).transpose(1, 2)
            got = ks.scores(q)
            assert got.shape == want.shape
            torch.testing.assert_close(got.masked_fill(~keep, 0), want.masked_fill(~keep, 0), atol=1e-12,
                                       rtol=1e-12)
            probs = torch.softmax(torch.randn(B * H, G, tk, dtype=dt).masked_fill(~keep, float("-inf")), -1)
            torch.testing.assert_close(vs.weighted_sum(probs), probs @ vr.reshape(B * H, tk, hd),
                                       atol=1e-12, rtol=1e-12)
        for c in caches:
            c.advance(1)
    assert caches[1].copies == 1 and caches[1].tables[4][1] != caches[1].tables[3][1]  # copy-on-write
    assert caches[1].tables[1][0] == caches[1].tables[0][0]  # the shared prefix block stays shared

