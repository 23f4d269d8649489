"""The paged block pool and the continuous-batching Engine (same tokens as the static cache)."""

from __future__ import annotations

import pytest
import torch
from _genmodels import POSITIONS, tiny_encdec, tiny_gpt

from qkv.generate import BlockAllocator, Engine, generate
from qkv.generate.text import decode_continuation


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
        # one row: ends at its eos
        ref = generate(m, torch.tensor([p]), n, eos_token_id=eos)[0, len(p):].tolist()
        assert out[rid] == ref


def _alone(m, prompt, n, **kw):
    """generate() on one prompt, nothing else in the batch: the reference for every engine output."""
    return generate(m, torch.tensor([prompt]), n, **kw)[0, len(prompt):].tolist()  # one row: no padding


def test_engine_checks_requests():
    m = tiny_gpt("rope", context=32)
    engine = Engine(m, block_size=4, num_blocks=4, max_batch_size=8)  # 16 positions in the pool
    with pytest.raises(ValueError, match="blocks"):
        engine.add_request(list(range(10)), 10)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([99], 2)
    with pytest.raises(ValueError, match="context"):
        Engine(tiny_gpt("learned", context=8)).add_request([1] * 6, 3)
    with pytest.raises(ValueError, match="decoder-only"):
        Engine(tiny_encdec())
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request([1, 2], 3, stop_strings=["x"])


def test_engine_sizes_are_checked_and_zero_new_tokens_is_reported_finished():
    m = tiny_gpt("rope", context=32)
    for kw, name in [(dict(block_size=0), "block_size"), (dict(max_batch_size=0), "max_batch_size"),
                     (dict(max_batch_size=-1), "max_batch_size"), (dict(num_blocks=0), "num_blocks")]:
        with pytest.raises(ValueError, match=f"{name} must be at least 1"):
            Engine(m, **kw)
    # max_new_tokens=0 ended at once but never reached take_finished(): an EngineWorker ticket waited forever
    engine = Engine(m, block_size=4)
    rid = engine.add_request([1, 2], 0)
    other = engine.add_request([1, 2], 2)
    engine.run()
    assert sorted(engine.take_finished()) == [rid, other] and engine.counters.finished == 2
    assert engine.finished[rid] == [] and engine.finish_reason[rid] == "length"


def test_max_model_len_defaults_to_the_configured_context_of_rope_models():
    """RoPE has no hard position limit, but the engine (like vLLM's max_model_len) refuses requests past the
    context the model was configured for, unless max_model_len raises it on purpose; learned positions cannot
    go past their table at all."""
    m = tiny_gpt("rope", context=16)
    engine = Engine(m, block_size=4, max_batch_size=2)
    assert engine.context == 16
    with pytest.raises(ValueError, match="exceeds the model's context of 16 positions"):
        engine.add_request(list(range(1, 11)), 7)
    engine.check_request(10, 6)
    # extrapolation, asked for
    wide = Engine(m, block_size=4, num_blocks=8, max_batch_size=2, max_model_len=24)
    rid = wide.add_request(list(range(1, 11)), 14)
    out = wide.run()[rid]
    with pytest.warns(UserWarning, match="24 positions runs past the model's context_length of 16"):
        want = generate(m, torch.tensor([list(range(1, 11))]), 14)[0, 10:].tolist()
    assert len(out) == 14 and out == want
    learned = tiny_gpt("learned", context=16)
    assert Engine(learned, block_size=4).context == 16
    with pytest.raises(ValueError, match="exceeds the model's context of 16"):
        Engine(learned, block_size=4, max_model_len=17)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_model_len( must be at least 1|: expected an integer)"):
            Engine(m, block_size=4, max_model_len=bad)


@pytest.mark.parametrize("policy", ["least_work", "newest"])
def test_preemption_by_recomputation_keeps_greedy_outputs(policy):
    # blocks are taken lazily: both requests start at once, the pool runs out, one is preempted and recomputed
    m = tiny_gpt("rope", context=64)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 11, (n,), generator=g).tolist() for n in (5, 2, 9, 3, 6)]
    news = [9, 12, 6, 10, 8]
    engine = Engine(m, block_size=4, num_blocks=6, max_batch_size=8, preemption=policy, prefill_chunk=4)
    ids = [engine.add_request(p, n) for p, n in zip(prompts, news)]
    engine.step()
    assert len(engine.running) >= 2  # not held back for the worst case
    out = engine.run()
    st = engine.stats()
    assert st["preemptions"] > 0 and st["recomputed_tokens"] > 0
    for rid, p, n in zip(ids, prompts, news):
        assert out[rid] == _alone(m, p, n)
    assert engine.cache.blocks_in_use == 0 and engine.cache.allocator.num_free == 6  # the pool is full again


def test_per_request_settings_in_one_batch():
    m = tiny_gpt("learned", context=64)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 11, (n,), generator=g).tolist() for n in (4, 7, 3, 5, 6)]
    decode = lambda ids: "".join(chr(97 + t) for t in ids)  # noqa: E731  a toy tokenizer: id -> letter
    engine = Engine(m, block_size=4, max_batch_size=8, tokenizer=decode)
    greedy = [engine.add_request(prompts[0], 10), engine.add_request(prompts[1], 6, eos_token_id=3)]
    sampled = engine.add_request(prompts[2], 12, do_sample=True, temperature=0.8, top_k=4, top_p=0.9, seed=7)
    stop = engine.add_request(prompts[3], 20, stop_strings=["c"])
    other = engine.add_request(prompts[4], 9, do_sample=True, seed=1)
    out = engine.run()
    assert out[greedy[0]] == _alone(m, prompts[0], 10)
    assert out[greedy[1]] == _alone(m, prompts[1], 6, eos_token_id=3)
    ref = _alone(m, prompts[3], 20)
    cut = next((i for i, t in enumerate(ref) if t == 2), len(ref) - 1)  # "c" is token 2
    assert out[stop] == ref[:cut + 1]
    assert engine.finish_reason[stop] == ("stop" if cut < len(ref) - 1 else "length")
    # a seeded request draws the same tokens alone, and whatever else shares its batches
    solo = Engine(m, block_size=4)
    rid = solo.add_request(prompts[2], 12, do_sample=True, temperature=0.8, top_k=4, top_p=0.9, seed=7)
    assert solo.run()[rid] == out[sampled] and len(out[other]) == 9


def test_prefix_caching_shares_blocks_and_keeps_outputs():
    m = tiny_gpt("alibi", context=64)
    g = torch.Generator().manual_seed(4)
    system = torch.randint(0, 11, (12,), generator=g).tolist()  # 3 full blocks of 4
    prompts = [system + torch.randint(0, 11, (n,), generator=g).tolist() for n in (3, 5, 0, 2)]
    engine = Engine(m, block_size=4, max_batch_size=8)
    first = engine.add_request(prompts[0], 6)
    engine.step()  # the shared prefix is computed once, then found by the next requests
    ids = [first] + [engine.add_request(p, 6) for p in prompts[1:]]
    engine.step()
    shared = engine.cache.tables[first][:3]
    assert all(engine.cache.allocator.ref_count(b) > 1 for b in shared)
    out = engine.run()
    for rid, p in zip(ids, prompts):
        assert out[rid] == _alone(m, p, 6)
    st = engine.stats()
    assert st["prefix_hit_tokens"] >= 3 * 12 - 1 and 0 < st["prefix_hit_rate"] < 1
    # prompts[2] is exactly the cached prefix: its last token is recomputed in a copy
    assert st["cow_copies"] >= 1
    assert engine.cache.blocks_in_use == 0 and st["blocks_cached"] > 0
    # the same requests again without the prefix cache: the same tokens, more prefill work
    plain = Engine(m, block_size=4, max_batch_size=8, prefix_caching=False)
    pids = [plain.add_request(p, 6) for p in prompts]
    pout = plain.run()
    assert [pout[r] for r in pids] == [out[r] for r in ids]
    assert plain.stats()["prefill_tokens"] > st["prefill_tokens"]


def test_prefix_cache_evicts_least_recently_used():
    m = tiny_gpt("rope", context=64)
    engine = Engine(m, block_size=4, num_blocks=8, max_batch_size=4)
    a = engine.add_request(list(range(8)), 2)  # 2 full prompt blocks stay cached after it finishes
    engine.run()
    assert engine.stats()["blocks_cached"] >= 2
    b = engine.add_request([1] * 24, 8)  # needs the whole pool: the cached blocks are evicted
    out = engine.run()
    assert out[b] == _alone(m, [1] * 24, 8) and out[a] == _alone(m, list(range(8)), 2)
    assert engine.cache.allocator.evictions >= 2


def test_cancel_frees_blocks():
    m = tiny_gpt("rope", context=64)
    engine = Engine(m, block_size=4, max_batch_size=1)
    a = engine.add_request([1, 2, 3, 4, 5, 6], 20)
    b = engine.add_request([3, 3], 5)  # waits: the batch holds one request
    for _ in range(3):
        engine.step()
    assert engine.cache.blocks_in_use > 0
    assert engine.cancel(a) and engine.cache.blocks_in_use == 0 and engine.finish_reason[a] == "cancelled"
    assert not engine.cancel(a) and not engine.cancel(12345)
    c = engine.add_request([4], 3)
    assert engine.cancel(c) and engine.take_finished() == [a, c]
    out = engine.run()
    assert out[b] == _alone(m, [3, 3], 5) and engine.cache.blocks_in_use == 0


@pytest.mark.parametrize("chunk", [3, None])
def test_chunked_prefill_keeps_running_requests_moving(chunk):
    m = tiny_gpt("sinusoidal", context=64)
    engine = Engine(m, block_size=4, max_batch_size=4, prefill_chunk=chunk)
    short = engine.add_request([2, 5], 30)
    engine.step()
    long_prompt = [(7 * i) % 11 for i in range(20)]
    long = engine.add_request(long_prompt, 4)
    steps = 0
    while long not in engine.finished:
        events = engine.step()
        steps += 1
        assert short in {r for r, _ in events}  # the running request gets its token every step
    assert steps == (-(-20 // chunk) if chunk else 1) + 3
    out = engine.run()
    assert out[long] == _alone(m, long_prompt, 4) and out[short] == _alone(m, [2, 5], 30)


def test_engine_sampling_is_seeded():
    m = tiny_gpt()
    runs = []
    for _ in range(2):
        e = Engine(m, do_sample=True, temperature=1.3, top_k=5, seed=3)
        for p in ([1, 2], [3, 4, 5]):
            e.add_request(p, 6)
        runs.append(e.run())
    assert runs[0] == runs[1]


def test_a_request_of_the_whole_pool_runs_after_its_prefix_was_cached():
    # a 16-token prompt fills the pool of 4 blocks of 4; run again, its cached blocks plus the copy-on-write
    # of the last one would need a fifth block, so the engine computes it again instead of sharing
    m = tiny_gpt("rope", context=64)
    engine = Engine(m, block_size=4, num_blocks=4)
    prompt = [(3 * i) % 11 for i in range(16)]
    a = engine.add_request(prompt, 1)
    engine.run()
    assert engine.stats()["blocks_cached"] == 4
    b = engine.add_request(prompt, 1)
    out = engine.run()
    assert out[a] == out[b] == _alone(m, prompt, 1)


def test_decode_batch_cut_by_length_keeps_tokens():
    # split_cost=1: the decoding batch is cut into groups of similar length whenever that saves any padding
    m = tiny_gpt("alibi", gqa=True, context=96)  # ALiBi: the bias is right-aligned per group
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 11, (n,), generator=g).tolist() for n in (2, 40, 3, 33, 5, 60, 4, 28)]
    engine = Engine(m, block_size=4, max_batch_size=8, split_cost=1)
    ids = [engine.add_request(p, 6) for p in prompts]
    engine.step()
    while not engine.waiting and any(r.computed < len(r.prompt) for r in engine.running):
        engine.step()  # until every prompt is in and the batch is decoding
    batch = list(engine.running)
    groups = engine._length_groups(batch)
    assert len(groups) > 1 and sorted(i for grp in groups for i in grp) == list(range(len(batch)))
    lens = [engine.cache.lens[r.id] for r in batch]
    for a, b in zip(groups, groups[1:]):  # groups of the length-sorted batch, shortest first
        assert max(lens[i] for i in a) <= min(lens[i] for i in b)
    engine.split_cost = None
    assert engine._length_groups(batch) == [list(range(len(batch)))]
    engine.split_cost = 1
    out = engine.run()
    for rid, p in zip(ids, prompts):
        assert out[rid] == _alone(m, p, 6)


def test_engine_reads_only_written_cache_slots():
    # the pool is not zeroed (torch.empty): fill it with NaN but slot 0 (the padding columns' source) and the
    # outputs must not change, so no step reads a slot that no token wrote
    m = tiny_gpt("rope", context=64)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 11, (n,), generator=g).tolist() for n in (7, 2, 13, 5)]
    engine = Engine(m, block_size=4, num_blocks=12, max_batch_size=4, prefill_chunk=5)
    c = engine.cache
    heads = c.v.view(c.v.shape[0], c.n_kv_heads, c.slots, -1)  # values: (layer, head, slot, hd)
    heads[:, :, 1:] = float("nan")
    assert bool((heads[:, :, 0] == 0).all())
    # keys: each block transposed
    blocks = c.k.view(c.k.shape[0], c.n_kv_heads, c.num_blocks, -1, c.block_size)
    blocks[:, :, 1:] = float("nan")
    blocks[:, :, 0, :, 1:] = float("nan")
    assert bool((blocks[:, :, 0, :, 0] == 0).all())
    ids = [engine.add_request(p, 9) for p in prompts]
    out = engine.run()
    assert engine.stats()["preemptions"] > 0  # recomputation and block reuse are part of the run
    for rid, p in zip(ids, prompts):
        assert out[rid] == _alone(m, p, 9)


@pytest.mark.parametrize("position", POSITIONS)
def test_prefill_pieces_of_equal_length_share_one_forward(position):
    """Prompt pieces of the same length go through one forward: fresh prompts (nothing cached), and a piece
    after an 8-token prefix-cache hit beside a fresh one (different cached lengths: per-row offsets and key
    mask). Every output equals generate() alone on its prompt."""
    m = tiny_gpt(position, gqa=position in ("rope", "alibi"))
    shapes = []
    step = m.step

    def recording(ids, cache, keep=None, offset=None):
        shapes.append((tuple(ids.shape), keep is not None))
        return step(ids, cache, keep=keep, offset=offset)

    m.step = recording
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 11, (8,), generator=g).tolist()
    first = prefix + [1, 2, 3]
    engine = Engine(m, block_size=4, max_batch_size=4, prefill_chunk=32)
    a = engine.add_request(first, 3)
    out = engine.run()  # leaves the prefix's two full blocks in the prefix cache
    prompts = [prefix + [4, 5, 6], [7, 8, 9], [2, 4, 6, 8, 10, 1], [3, 5, 7, 9, 2, 4]]
    news = [5, 6, 4, 7]
    ids = [engine.add_request(p, n) for p, n in zip(prompts, news)]
    out.update(engine.run())
    assert ((2, 3), True) in shapes  # the prefix-hit piece (8 cached) beside the fresh 3-token prompt
    assert ((2, 6), False) in shapes  # two fresh 6-token prompts
    assert engine.stats()["prefix_hit_tokens"] == 8
    assert out[a] == _alone(m, first, 3)
    for rid, p, n in zip(ids, prompts, news):
        assert out[rid] == _alone(m, p, n)


def test_engine_split_cost_auto_cuts_the_batch_only_where_the_step_gathers():
    # the CPU float32 paged step reads K/V in place (no padding read): one forward per decoding step
    m = tiny_gpt("rope", context=64)
    assert Engine(m).split_cost is None and Engine(m).cache.step_reads_in_place
    assert Engine(m, split_cost=4096).split_cost == 4096
    half = Engine(m.to(torch.bfloat16))  # bf16 gathers K/V: the length split pays for itself
    assert not half.cache.step_reads_in_place and half.split_cost == 4096
    with pytest.raises(ValueError, match="split_cost"):
        Engine(m, split_cost="none")


def test_a_request_whose_sampling_fails_fails_alone():
    """A repetition_penalty of 1e-300 divides the seen tokens' logits into inf (then NaN probabilities, which
    torch.multinomial refuses): that request finishes with "error" and its message, the engine keeps stepping
    and the request beside it gets the tokens it gets alone."""
    m = tiny_gpt("rope", context=64)
    engine = Engine(m, block_size=4, max_batch_size=4)
    bad = engine.add_request([1, 2, 3], 8, do_sample=True, repetition_penalty=1e-300, seed=0)
    good = engine.add_request([3, 3], 6)
    out = engine.run()
    assert engine.finish_reason[bad] == "error" and out[bad] == []
    assert "sampling failed" in engine.errors[bad]
    assert out[good] == _alone(m, [3, 3], 6) and engine.finish_reason[good] == "length"
    assert engine.cache.blocks_in_use == 0
    assert engine.pop_finished(bad) == ([], "error") and bad not in engine.errors


def test_a_stop_string_with_the_first_words_leading_space_stops_the_request(llama_sp):
    """A SentencePiece-style folder: the output's text is what it adds after the prompt, " con..." with its
    space (the server's text, decoded after the prompt's tail). A stop string " con" at its very start stops
    the request at once; the output decoded alone ("con...") lost that space, and would never stop it."""
    from qkv.serve import load_served

    served = load_served(llama_sp[0])
    decode = served.codec.decode
    ids = served.codec.encode("Hello")
    engine = Engine(served.model, block_size=4, tokenizer=served.codec)
    rid = engine.add_request(ids, 8)
    out = engine.run()[rid]
    text = decode_continuation(decode, ids[-5:], out)
    word = " " + text.split()[0]
    assert text.startswith(word) and not decode(out).startswith(" ")  # what the old check looked in
    rid = engine.add_request(ids, 8, stop_strings=[word])
    assert engine.run()[rid] == out[:1] and engine.finish_reason[rid] == "stop"


def test_the_stop_check_decodes_a_window_not_the_whole_output():
    """Each token decodes the last 4 x (longest stop) + 1 tokens and a few before them, not the whole output
    (O(length) a token): the longest decode is bounded whatever the output's length."""
    m = tiny_gpt("rope", context=128)
    lengths = []

    def decode(ids):
        lengths.append(len(ids))
        return "".join("abcdefghijk"[i] for i in ids)

    engine = Engine(m, block_size=4, tokenizer=decode)
    rid = engine.add_request([1, 2, 3], 60, stop_strings=["zz"])  # never found: a-k only
    out = engine.run()[rid]
    assert len(out) == 60 and engine.finish_reason[rid] == "length"
    assert max(lengths) <= 5 + 4 * 2 + 1
