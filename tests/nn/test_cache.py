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
