"""The Engine's parts on their own: block manager, scheduler, sampler, output processor (no model)."""

from __future__ import annotations

import pytest
import torch

from qkv.generate.blocks import BlockManager
from qkv.generate.config import GenerationConfig
from qkv.generate.output import OutputProcessor, StopStrings
from qkv.generate.sampler import Sampler
from qkv.generate.scheduler import Counters, Request, Scheduler
from qkv.nn.paged import PagedKVCache


def _blocks(num_blocks: int, block_size: int = 4, prefix_caching: bool = True) -> BlockManager:
    return BlockManager(PagedKVCache(1, 1, 2, num_blocks, block_size), prefix_caching)


def _request(rid: int, prompt: list[int], **cfg) -> Request:
    return Request(rid, prompt, GenerationConfig(**cfg), 4, set(), None)


def _scheduler(bm: BlockManager, preemption: str = "least_work", split_cost: int | None = None) -> Scheduler:
    return Scheduler(bm, Counters(), max_batch_size=8, prefill_chunk=None, preemption=preemption,
                     split_cost=split_cost)


def test_block_manager_prefix_hits_and_frees():
    bm = _blocks(8)
    toks = list(range(1, 11))  # 10 tokens: 2 full blocks of 4 + 2
    bm.allocate(0, [], 0)
    assert bm.reserve(0, 10) and bm.cache.blocks_in_use == 3
    bm.cache.lens[0] = 10
    digests: list[bytes] = []
    bm.register(0, toks, 10, digests)
    assert len(digests) == 2 and bm.allocator.num_cached == 0  # registered, still held
    blocks, found = bm.cached_prefix(toks)
    assert blocks == bm.cache.tables[0][:2] and found == digests
    assert len(bm.cached_prefix(toks[:4] + [99] + toks[5:])[0]) == 1  # the second block differs
    assert bm.cached_prefix([99] + toks[1:]) == ([], [])  # keys chain from position 0
    assert bm.head(toks) == digests[0] and bm.head(toks[:3]) == b""
    bm.free(0)
    assert bm.cache.blocks_in_use == 0 and bm.allocator.num_cached == 2 and bm.allocator.num_free == 8
    # a new sequence of the same 10 tokens: 8 found, 1 block to compute; of 8 tokens: the last token is fed
    # again, into a copy of the shared last block
    assert bm.admission(10, blocks, others_running=False) == (8, 1, 8 - 2)
    assert bm.admission(8, blocks, others_running=True) == (7, 1, 8 - 2 - bm.watermark)
    assert _blocks(8, prefix_caching=False).cached_prefix(toks) == ([], [])


def test_scheduler_admits_no_more_than_the_free_blocks_allow():
    bm = _blocks(5, prefix_caching=False)  # watermark 1 while others run
    s = _scheduler(bm)
    a, b, c, d = (_request(i, list(range(10 * i, 10 * i + n))) for i, n in enumerate((8, 8, 8, 1)))
    s.waiting.append(a)
    s.admit()
    assert s.running == [a] and s.prefill_groups() == {8: [a]} and bm.allocator.num_free == 3
    a.computed = 8
    s.waiting.append(b)
    s.admit()  # needs 2 of 3 free - 1 watermark
    assert s.running == [a, b] and s.prefill_groups() == {8: [b]} and bm.allocator.num_free == 1
    b.computed = 8
    s.waiting.extend([c, d])
    s.admit()  # c needs 2 > 1 - 1; d would fit but waits behind c (first come, first served)
    assert s.running == [a, b] and list(s.waiting) == [c, d]
    assert s.counters.prompt_tokens == 16
    s.finish(a)
    s.admit()
    assert s.running == [b, c, d] and not s.waiting


def test_scheduler_preempts_the_least_work_and_requeues_it_first():
    bm = _blocks(4, prefix_caching=False)
    s = _scheduler(bm)
    a, b = _request(0, list(range(8))), _request(1, list(range(4)))
    s.waiting.extend([a, b])
    s.admit()
    assert s.prefill_groups() == {8: [a], 4: [b]} and bm.allocator.num_free == 1
    a.computed, b.computed = 8, 4
    bm.cache.lens.update({0: 8, 1: 4})  # what the forward would have written
    later = _request(2, [5])
    s.waiting.append(later)
    assert s.reserve(a, 8)  # a needs 2 more blocks: b (4 computed tokens) goes
    assert s.running == [a] and list(s.waiting) == [b, later] and b.computed == 0 and b.preemptions == 1
    assert s.counters.preemptions == 1 and s.counters.recomputed_tokens == 4
    assert s.cancel(2) is later and s.cancel(2) is None


def test_scheduler_length_groups():
    s = _scheduler(_blocks(4), "newest", split_cost=1)
    batch = [_request(i, [1]) for i in range(6)]
    lens = [500, 3, 480, 4, 2, 510]
    groups = s.length_groups(batch, lens)
    assert sorted(i for g in groups for i in g) == list(range(6)) and len(groups) >= 2
    assert sorted(groups[0]) == [1, 3, 4]  # the short rows apart from the long ones
    s.split_cost = None
    assert s.length_groups(batch, lens) == [list(range(6))]


def test_sampler_seeded_request_is_reproducible_whatever_the_batch():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))

    def draws(with_others: bool) -> list[int]:
        sampler = Sampler(torch.device("cpu"), None, {})
        seeded = _request(0, [1, 2], do_sample=True, top_k=8, seed=11)
        seeded.pipe = sampler.pipeline(seeded.cfg, 2, 4, own_seed=True)
        reqs, rows = [seeded], [0]
        if with_others:
            other = _request(1, [3], do_sample=True)
            other.pipe = sampler.pipeline(other.cfg, 1, 4, own_seed=False)
            greedy = _request(2, [4])
            greedy.pipe = sampler.pipeline(greedy.cfg, 1, 4, own_seed=False)
            reqs, rows = [other, seeded, greedy], [1, 0, 2]
        out = []
        for _ in range(5):
            toks = sampler.choose(reqs, logits[rows])
            out.append(toks[reqs.index(seeded)])
            if with_others:
                assert toks[2] == int(logits[2].argmax())
        return out

    assert draws(False) == draws(True)
    a, b = (Sampler(torch.device("cpu"), 5, {}) for _ in range(2))
    assert torch.equal(torch.rand(4, generator=a.generator), torch.rand(4, generator=b.generator))


def test_sampler_failure_is_the_requests_own():
    errors: dict[int, str] = {}
    sampler = Sampler(torch.device("cpu"), 0, errors)
    bad = _request(7, [1, 2, 3], do_sample=True, repetition_penalty=1e-300)
    bad.pipe = sampler.pipeline(bad.cfg, 3, 4, own_seed=False)
    good = _request(8, [1])
    good.pipe = sampler.pipeline(good.cfg, 1, 4, own_seed=False)
    logits = torch.randn(2, 6)
    assert sampler.choose([bad, good], logits) == [None, int(logits[1].argmax())]
    assert "sampling failed" in errors[7]


WORDS = {0: " he", 1: " con", 2: "llo", 3: "x"}


def _metaspace(ids: list[int]) -> str:
    """A toy SentencePiece-style decoder: the text's first leading space is dropped."""
    return "".join(WORDS[i] for i in ids).removeprefix(" ")


def test_stop_strings_read_the_text_after_the_prompt():
    assert StopStrings(_metaspace, [" con"], context=[0]).push(1)  # " he" + " con"
    assert not StopStrings(_metaspace, [" con"], context=[]).push(1)  # alone: "con"
    s = StopStrings(_metaspace, ["llo he"], context=[3])
    assert [s.push(t) for t in (2, 3, 2, 0)] == [False, False, False, True]  # across two tokens


def test_output_processor_finish_reasons():
    c = Counters()
    out = OutputProcessor(_metaspace, c)
    events: list[tuple[int, int]] = []
    r = _request(0, [3])
    r.eos, r.max_new_tokens, r.stop = {3}, 2, out.stop_strings([3], ["llo"])
    assert out.process(r, 0, events) is None and out.process(r, 3, events) == "stop"  # eos
    r2 = _request(1, [3])
    r2.max_new_tokens, r2.stop = 3, out.stop_strings([3], ["llo"])
    assert out.process(r2, 0, events) is None and out.process(r2, 2, events) == "stop"  # " hello"
    r3 = _request(2, [3])
    r3.max_new_tokens = 1
    assert out.process(r3, 1, events) == "length" and out.process(r3, None, events) == "error"
    assert events == [(0, 0), (0, 3), (1, 0), (1, 2), (2, 1)] and c.generated_tokens == 5
    out.finish(2, r3.output, "length")
    out.finish(5, [], "cancelled")
    assert out.take() == [2, 5] and out.take() == [] and (c.finished, c.cancelled) == (1, 1)
    assert out.pop(2) == ([1], "length") and out.pop(2) is None
    with pytest.raises(ValueError, match="tokenizer"):
        OutputProcessor(None, c).stop_strings([1], ["x"])
