"""StaticCache.reorder (beam search): the filled positions are gathered in place, the same values as
index_select over the whole buffer; cross=False keeps the encoder K/V and mask, a new batch size reallocates."""

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
    torch.testing.assert_close(kl[:, :, :2], k[0].index_select(0, torch.tensor([0, 0, 1, 1, 1])), rtol=0, atol=0)


def test_paged_step_update_leaves_values_in_the_pool_and_weighs_them_like_a_matmul():
    """The paged cache's decoding-step update: the keys equal update()'s gathered keys, and the values'
    weighted sum (embedding_bag over pool rows) equals probs @ the gathered values, computed in float64, for
    grouped queries (3 query heads per key/value head) and rows of different lengths (masked columns)."""
    from qkv.nn.paged import PagedKVCache, PoolRows

    torch.manual_seed(0)
    H, hd, G = 2, 8, 3
    caches = [PagedKVCache(1, H, hd, num_blocks=12, block_size=4) for _ in range(2)]
    for c in caches:
        for s in range(3):
            c.add_sequence(s)
    fills = {s: (torch.randn(1, H, n, hd), torch.randn(1, H, n, hd)) for s, n in enumerate([5, 11, 1])}
    for c in caches:
        for s, (k, v) in fills.items():
            c.set_active([s])
            c.update(0, k, v)
            c.advance(k.shape[2])
        c.set_active([0, 1, 2])
    k1, v1 = torch.randn(3, H, 1, hd), torch.randn(3, H, 1, hd)
    kr, vr = caches[0].update(0, k1, v1)
    ks, vs = caches[1].step_update(0, k1, v1)
    assert isinstance(vs, PoolRows) and torch.equal(ks, kr)
    tk = kr.shape[2]
    keep = caches[1].keep_mask(1)  # (3, tk)
    scores = torch.randn(3 * H, G, tk).masked_fill(~keep.repeat_interleave(H, 0)[:, None, :], float("-inf"))
    probs = torch.softmax(scores, -1)
    want = probs.double() @ vr.reshape(3 * H, tk, hd).double()
    torch.testing.assert_close(vs.weighted_sum(probs).double(), want, atol=1e-6, rtol=1e-6)
