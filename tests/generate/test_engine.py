"""The paged block pool and the continuous-batching Engine (same tokens as the static cache)."""

from __future__ import annotations

import pytest
import torch
from _genmodels import POSITIONS, tiny_encdec, tiny_gpt

from qkv.generate import BlockAllocator, Engine, generate


def test_block_allocator():
    a = BlockAllocator(3)
    got = [a.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and a.num_free == 0
    with pytest.raises(RuntimeError, match="out of blocks"):
        a.allocate()
    a.free([got[1]])
    assert a.num_free == 1 and a.allocate() == got[1]
    a.free([got[0]])
    with pytest.raises(ValueError, match="double free"):
        a.free([got[0]])


@pytest.mark.parametrize("position", POSITIONS)
def test_engine_equals_static_generate_with_joining_requests(position):
    m = tiny_gpt(position, gqa=position in ("rope", "alibi"))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 11, (n,), generator=g).tolist() for n in (3, 9, 1, 5, 12, 2)]
    news = [7, 3, 10, 5, 4, 8]
    eos = 4
    engine = Engine(m, block_size=4, max_batch_size=3, eos_token_id=eos)
    ids = [engine.add_request(p, n) for p, n in zip(prompts[:4], news[:4])]
    for _ in range(3):  # two more requests join while others are running
        engine.step()
        for s in engine.cache.active:  # lazily allocated: at most one partly filled block each
            assert len(engine.cache.tables[s]) == -(-engine.cache.lens[s] // 4)
    ids += [engine.add_request(p, n) for p, n in zip(prompts[4:], news[4:])]
    out = engine.run()
    assert engine.cache.blocks_in_use == 0  # everything went back to the pool
    for rid, p, n in zip(ids, prompts, news):
        ref = generate(m, torch.tensor([p]), n, eos_token_id=eos, pad_token_id=-1)[0, len(p):].tolist()
        ref = [t for t in ref if t != -1] if -1 in ref else ref
        assert out[rid] == ref


def test_engine_waits_for_free_blocks_and_checks_requests():
    m = tiny_gpt("rope", context=32)
    engine = Engine(m, block_size=4, num_blocks=4, max_batch_size=8)  # 16 positions in the pool
    a = engine.add_request([1, 2, 3, 4, 5], 6)  # needs 3 blocks
    b = engine.add_request([6, 7], 5)  # needs 2: must wait until a leaves
    engine.step()
    assert len(engine.running) == 1 and len(engine.waiting) == 1
    out = engine.run()
    for rid, p, n in ((a, [1, 2, 3, 4, 5], 6), (b, [6, 7], 5)):
        assert out[rid] == generate(m, torch.tensor([p]), n)[0, len(p):].tolist()
    with pytest.raises(ValueError, match="blocks"):
        engine.add_request(list(range(10)), 10)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([99], 2)
    with pytest.raises(ValueError, match="context"):
        Engine(tiny_gpt("learned", context=8)).add_request([1] * 6, 3)
    with pytest.raises(ValueError, match="decoder-only"):
        Engine(tiny_encdec())


def test_engine_sampling_is_seeded():
    m = tiny_gpt()
    runs = []
    for _ in range(2):
        e = Engine(m, do_sample=True, temperature=1.3, top_k=5, seed=3)
        for p in ([1, 2], [3, 4, 5]):
            e.add_request(p, 6)
        runs.append(e.run())
    assert runs[0] == runs[1]
