"""The Engine's speculative decoding with a draft model (engine_speculation.Drafter): greedy tokens identical
to the engine without it and to generate() alone for a mixed batch, with a draft that disagrees (drafts
rejected and rolled back) and with the target as its own draft (every draft accepted); a draft of a smaller
vocabulary; a request's own prompt_lookup_num_tokens still means prompt lookup; no block and no draft state
left by finished, cancelled or preempted requests; sampling through the rejection rule with the draft's
probabilities, distributed as the model (chi-square against the exact distribution)."""

from __future__ import annotations

import pytest
import torch
from _genmodels import tiny_encdec, tiny_gpt
from _sampling import assert_samples_match, exact_sequences

import qkv.generate.engine_speculation as engine_speculation
from qkv.config import ConfigError
from qkv.generate import Engine, EngineConfig, generate

PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4], [1, 2], [7, 8, 9, 10, 1, 2, 3, 7, 8, 9, 10, 1], [5, 5, 5, 5, 5],
           [0, 6, 2, 9, 4, 1, 8]]
MAX_NEW = (40, 25, 40, 33, 17)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target = tiny_gpt("rope", vocab=11, context=128)
    torch.manual_seed(1)
    # a weaker, different model: agrees with the target on some tokens, not all
    other = tiny_gpt("rope", vocab=11, context=128, init_std=0.1)
    return target, other


def _run(model, draft=None, prompts=PROMPTS, max_new=MAX_NEW, engine_opts=None, **opts):
    engine = Engine(model, block_size=4, speculative_tokens=4, draft_model=draft, **(engine_opts or {}))
    ids = [engine.add_request(p, max_new_tokens=n, **opts) for p, n in zip(prompts, max_new)]
    out = engine.run()
    return engine, [out[i] for i in ids]


def test_greedy_equals_plain_engine_and_generate_with_a_disagreeing_draft_and_with_itself(models):
    target, other = models
    plain_engine, plain = _run(target)
    for p, n, out in zip(PROMPTS, MAX_NEW, plain):
        assert generate(target, torch.tensor([p]), max_new_tokens=n)[0, len(p):].tolist() == out
    engine, got = _run(target, other)
    assert got == plain
    st = engine.stats()
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"]  # some drafts rejected: rolled back
    assert st["generated_tokens"] == sum(len(o) for o in got)
    assert st["blocks_used"] == 0 and engine.drafter.requests == set()  # every request gone: nothing held
    assert engine.drafter.cache.allocator.num_free == engine.drafter.cache.num_blocks
    # the target drafting for itself: every draft is its own greedy choice
    engine, got = _run(target, target)
    assert got == plain
    st = engine.stats()
    assert st["spec_acceptance_rate"] == 1.0 and st["spec_draft_tokens"] > 0
    assert engine.steps < plain_engine.steps / 2  # up to 5 tokens a step
    assert st["blocks_used"] == 0 and engine.drafter.requests == set()


def test_a_draft_of_a_smaller_vocabulary_and_eos(models):
    """The draft's logits are padded to the target's vocabulary with -inf (those tokens never drafted)."""
    target, _ = models
    torch.manual_seed(2)
    small = tiny_gpt("rope", vocab=9, context=128)
    _, plain = _run(target, eos_token_id=4)
    engine, got = _run(target, small, eos_token_id=4)
    assert got == plain and any(o and o[-1] == 4 for o in plain)  # some stopped at eos
    assert engine.stats()["spec_draft_tokens"] > 0


def test_a_request_asking_for_prompt_lookup_gets_it(models):
    target, other = models
    engine = Engine(target, block_size=4, speculative_tokens=4, draft_model=other)
    lookup = engine.add_request(PROMPTS[0], max_new_tokens=30, prompt_lookup_num_tokens=3)
    drafted = engine.add_request(PROMPTS[0], max_new_tokens=30)
    seen = set()
    while engine.has_work:
        engine.step()
        seen |= set(engine.drafter.requests)
    assert seen == {drafted}  # only the other one has a draft model cache
    assert engine.finished[lookup] == engine.finished[drafted] == _run(target, prompts=PROMPTS[:1],
                                                                      max_new=(30,))[1][0]


def test_cancelled_and_preempted_requests_leave_no_draft_state(models):
    target, other = models
    engine = Engine(target, block_size=4, speculative_tokens=4, draft_model=other)
    rids = [engine.add_request(p, max_new_tokens=20) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    assert set(engine.drafter.requests) == set(rids)
    assert engine.cancel(rids[1])
    assert rids[1] not in engine.drafter.requests
    engine.run()
    assert engine.drafter.requests == set() and engine.stats()["blocks_used"] == 0
    assert engine.drafter.cache.allocator.num_free == engine.drafter.cache.num_blocks
    # a pool a third of what the batch needs: requests are preempted (recomputed) and their draft sequences
    # dropped, rebuilt when they decode again; the draft's pool (as small) runs out too (~1 in 8 drafts
    # here: those rows decode plainly that step); the tokens are still plain greedy's
    want = _run(target, max_new=(60,) * 5)[1]
    engine = Engine(target, block_size=4, num_blocks=24, speculative_tokens=4, draft_model=other)
    rids = [engine.add_request(p, max_new_tokens=60) for p in PROMPTS]
    while engine.has_work:
        engine.step()
        assert set(engine.drafter.requests) <= {r.id for r in engine.running}
    assert engine.stats()["preemptions"] > 0 and engine.stats()["spec_accepted_tokens"] > 0
    assert [engine.finished[r] for r in rids] == want
    assert engine.drafter.requests == set() and engine.stats()["blocks_used"] == 0


def test_bad_settings(models):
    target, other = models
    with pytest.raises(ValueError, match="draft_model="):
        Engine(target, speculative="some/folder")  # a folder is loaded by qkv serve, not the Engine
    with pytest.raises(ValueError, match="one drafter"):
        Engine(target, speculative="prompt-lookup", draft_model=other)
    with pytest.raises(ValueError, match="decoder-only"):
        Engine(target, draft_model=tiny_encdec())
    with pytest.raises(ConfigError, match="speculative"):
        EngineConfig(speculative="")


def test_sampling_goes_through_the_rule_with_the_drafts_probabilities(monkeypatch):
    """A draft whose distribution differs from the target's (q != p): the accepted and resampled tokens
    are distributed as plain sampling from the target. The draft's q reaches the rule (a drawn token taken
    as certain would be exact too, only accepted less often); a wrong q (uniform) fails the chi-square
    test at p ~ 1e-21."""
    probs = []
    real = engine_speculation.target_choices

    def spy(pipe, buf, cur, logits, draft, stats):
        probs.append(draft.probs)
        return real(pipe, buf, cur, logits, draft, stats)

    monkeypatch.setattr(engine_speculation, "target_choices", spy)
    torch.manual_seed(3)
    small = tiny_gpt("rope", vocab=4, context=32)
    torch.manual_seed(4)
    draft = tiny_gpt("rope", vocab=4, context=32)
    prompt, n, N = [1, 2, 3, 0, 2], 3, 1200
    engine = Engine(small, block_size=4, max_batch_size=64, speculative_tokens=2, draft_model=draft)
    rids = [engine.add_request(prompt, max_new_tokens=n, do_sample=True, seed=s) for s in range(N)]
    out = engine.run()
    assert probs and all(p is not None and p.shape == (1, 4) for p in probs)  # the room left: one draft
    st = engine.stats()
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"]
    assert_samples_match([out[r] for r in rids], exact_sequences(small, prompt, n, 4))
