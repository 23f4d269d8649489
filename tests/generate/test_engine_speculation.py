"""The Engine's speculative decoding by prompt lookup (engine_speculation.py): greedy tokens identical to the
engine without it and to generate() alone, for a batch of prompts that repeat (drafts accepted) and that do
not, with eos, stop strings, max_new_tokens and logprobs; the rejected positions' blocks given back and never
in the prefix cache; sampling through speculative.py's rule, distributed as the model (chi-square against the
exact distribution enumerated with the model's forward); the fallbacks."""

from __future__ import annotations

import pytest
import torch
from _genmodels import tiny_gpt
from _sampling import assert_samples_match, exact_sequences

import qkv.generate.engine_speculation as engine_speculation
from qkv.generate import Engine, GenerationConfig, generate
from qkv.generate.blocks import block_key
from qkv.generate.engine_speculation import draft_length
from qkv.nn.paged import PagedKVCache

PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4], [1, 2], [7, 8, 9, 10, 1, 2, 3, 7, 8, 9, 10, 1], [5, 5, 5, 5, 5],
           [0, 6, 2, 9, 4, 1, 8]]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_gpt("rope", vocab=11, context=128)


def _run(model, spec: str | None, prompts=PROMPTS, max_new=(40, 25, 40, 33, 17), **opts):
    engine = Engine(model, block_size=4, speculative=spec, speculative_tokens=4, **opts.pop("engine", {}))
    ids = [engine.add_request(p, max_new_tokens=n, **opts) for p, n in zip(prompts, max_new)]
    out = engine.run()
    return engine, [out[i] for i in ids]


def _true_digests(engine: Engine, sequences: list[list[int]]) -> set[bytes]:
    """The prefix-cache keys of every full block of these token sequences (prompt + output)."""
    bs, keys = engine.cache.block_size, set()
    for seq in sequences:
        parent = b""
        for i in range(len(seq) // bs):
            parent = block_key(parent, seq[i * bs:(i + 1) * bs])
            keys.add(parent)
    return keys


def test_greedy_equals_plain_engine_and_generate_and_rejected_blocks_are_given_back(model):
    plain_engine, plain = _run(model, None)
    engine, spec = _run(model, "prompt-lookup")
    assert spec == plain
    for p, n, out in zip(PROMPTS, (40, 25, 40, 33, 17), spec):
        assert generate(model, torch.tensor([p]), max_new_tokens=n)[0, len(p):].tolist() == out
    st = engine.stats()
    assert st["spec_accepted_tokens"] > 0 and 0 < st["spec_acceptance_rate"] <= 1
    assert st["spec_draft_tokens"] > st["spec_accepted_tokens"]  # some drafts were rejected: rolled back
    assert engine.steps < plain_engine.steps  # accepted drafts: fewer steps than tokens
    assert st["generated_tokens"] == sum(len(o) for o in spec)
    # every request finished: no block referenced; the cached blocks are exactly full blocks of the real
    # sequences (the last token of each was never fed), none holding a rejected draft
    assert st["blocks_used"] == 0
    real = _true_digests(engine, [p + o[:-1] for p, o in zip(PROMPTS, spec)])
    assert st["blocks_cached"] == sum(engine.cache.allocator.lookup(d) is not None for d in real) > 0
    # the cached blocks' keys/values are the right ones: prompts that continue the first wave's sequences
    # (their prefixes found in the cache) decode as generate() does
    again = [p + o[:9] for p, o in zip(PROMPTS, spec)]
    engine_ids = [engine.add_request(p, max_new_tokens=12) for p in again]
    out = engine.run()
    assert engine.stats()["prefix_hit_tokens"] > 0
    for p, rid in zip(again, engine_ids):
        assert out[rid] == generate(model, torch.tensor([p]), max_new_tokens=12)[0, len(p):].tolist()


def test_eos_stop_strings_and_logprobs_as_plain_decoding(model):
    letters = "abcdefghijk"

    def decode(ids):
        return "".join(letters[i] for i in ids)

    opts = dict(eos_token_id=4, engine=dict(tokenizer=decode))
    _, plain = _run(model, None, **opts)
    _, spec = _run(model, "prompt-lookup", **opts)
    assert spec == plain and any(o and o[-1] == 4 for o in plain)  # some stopped at eos
    stops = {"stop_strings": ["iif", "bd"]}
    _, plain = _run(model, None, **stops, engine=dict(tokenizer=decode))
    engine, spec = _run(model, "prompt-lookup", **stops, engine=dict(tokenizer=decode))
    assert spec == plain and engine.stats()["spec_accepted_tokens"] > 0
    assert any(len(o) < n for o, n in zip(plain, (40, 25, 40, 33, 17)))  # some stopped on a string
    # log-probabilities: one entry per token, those of plain decoding
    entries = {}
    for spec_mode in (None, "prompt-lookup"):
        engine = Engine(model, block_size=4, speculative=spec_mode, speculative_tokens=4)
        rids = [engine.add_request(p, max_new_tokens=20, logprobs=2) for p in PROMPTS]
        engine.step()
        while engine.has_work:
            engine.step()
        entries[spec_mode] = [(engine.finished[r], engine.token_logprobs(r)) for r in rids]
    for (toks_a, lp_a), (toks_b, lp_b) in zip(entries[None], entries["prompt-lookup"]):
        assert toks_a == toks_b and len(lp_a) == len(lp_b) == len(toks_a)
        for a, b in zip(lp_a, lp_b):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [i for i, _ in a.top] == [i for i, _ in b.top]


def test_a_request_speculates_on_its_own_and_a_short_pool_decodes_plainly(model):
    # one request's own prompt_lookup_num_tokens, the engine's setting off
    engine = Engine(model, block_size=4)
    rid = engine.add_request(PROMPTS[0], max_new_tokens=30, prompt_lookup_num_tokens=3)
    plain = engine.add_request(PROMPTS[0], max_new_tokens=30)
    out = engine.run()
    assert out[rid] == out[plain] and engine.stats()["spec_accepted_tokens"] > 0
    # blocks for the drafts only when free: a pool the requests fill needs no preemption for them
    want = _run(model, None)[1]
    engine, got = _run(model, "prompt-lookup", engine=dict(num_blocks=40))
    assert got == want and engine.stats()["preemptions"] == _run(
        model, None, engine=dict(num_blocks=40))[0].stats()["preemptions"]


def test_parallel_samples_on_shared_blocks_speculate_on_their_own(model):
    """n=3 greedy choices of one prompt start on its blocks (copy-on-write) and each speculates and rolls
    back its own: all three are generate()'s tokens, and every block comes back."""
    engine = Engine(model, block_size=4, speculative="prompt-lookup", speculative_tokens=4)
    prompt = PROMPTS[2] + [4]  # a partial last block: shared by the three, copied by each first writer
    rid = engine.add_request(prompt, max_new_tokens=30, n=3)
    out = engine.run()
    want = generate(model, torch.tensor([prompt]), max_new_tokens=30)[0, len(prompt):].tolist()
    assert [out[rid + i] for i in range(3)] == [want] * 3
    st = engine.stats()
    assert st["spec_accepted_tokens"] > 0 and st["blocks_used"] == 0 and st["cow_copies"] >= 2


def test_fallbacks():
    assert draft_length(GenerationConfig(grammar='start: "a"'), 5) == 0  # its matcher follows every scoring
    assert draft_length(GenerationConfig(), None) == 0
    assert draft_length(GenerationConfig(), 5) == 5
    assert draft_length(GenerationConfig(prompt_lookup_num_tokens=3), 5) == 3


def test_truncate_gives_back_whole_blocks():
    cache = PagedKVCache(1, 1, 2, num_blocks=6, block_size=4)
    cache.add_sequence(0)
    assert cache.reserve(0, 11)
    cache.lens[0] = 11  # as if a forward wrote 11 positions
    free = cache.allocator.num_free
    cache.truncate(0, 5)
    assert cache.lens[0] == 5 and len(cache.tables[0]) == 2 and cache.allocator.num_free == free + 1
    cache.truncate(0, 4)
    assert len(cache.tables[0]) == 1 and cache.allocator.num_free == free + 2


def test_sampling_goes_through_the_rule_and_matches_the_model(model, monkeypatch):
    calls = []
    real = engine_speculation.target_choices

    def spy(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(engine_speculation, "target_choices", spy)
    torch.manual_seed(3)
    small = tiny_gpt("rope", vocab=4, context=32)
    prompt, n, N = [1, 2, 3, 1, 2, 3, 1, 2], 3, 1200
    engine = Engine(small, block_size=4, max_batch_size=64, speculative="prompt-lookup", speculative_tokens=2)
    rids = [engine.add_request(prompt, max_new_tokens=n, do_sample=True, seed=s) for s in range(N)]
    out = engine.run()
    assert calls and engine.stats()["spec_accepted_tokens"] > 0
    assert_samples_match([out[r] for r in rids], exact_sequences(small, prompt, n, 4))
