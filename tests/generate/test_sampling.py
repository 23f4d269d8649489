"""Logits processors against hand-computed cases and Hugging Face's warpers; seeded sampling."""

from __future__ import annotations

import math

import pytest
import torch
from _genmodels import tiny_gpt

from qkv.generate import GenerationConfig, generate, top_k_filter, top_p_filter
from qkv.generate.processors import Context, Pipeline
from qkv.generate.sampling import sample

NEG = float("-inf")


def test_top_k_hand_case():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 4.0, 2.0]])
    got = top_k_filter(logits, 2)
    want = torch.tensor([[NEG, 3.0, 2.0, NEG], [NEG, NEG, 4.0, 2.0]])
    assert torch.equal(got, want)
    assert torch.equal(top_k_filter(logits, None), logits) and torch.equal(top_k_filter(logits, 4), logits)


@pytest.mark.parametrize("p,kept", [(0.5, 1), (0.7, 2), (0.8, 2), (0.81, 3), (0.96, 4), (1.0, 4)])
def test_top_p_hand_case(p, kept):
    # probabilities 0.5, 0.3, 0.15, 0.05 (shuffled): keep the smallest prefix whose mass reaches p
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    got = top_p_filter(probs.log().unsqueeze(0), p)[0]
    order = [1, 3, 0, 2]  # descending probability
    expect_kept = set(order[:kept])
    assert {i for i in range(4) if got[i] > NEG} == expect_kept


def test_filters_match_hugging_face_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(6, 50) * 3
    for k in (1, 5, 20):
        assert torch.equal(top_k_filter(logits, k), TopKLogitsWarper(k)(None, logits.clone()))
    for p in (0.1, 0.5, 0.9):
        ours = top_p_filter(logits, p)
        hf = TopPLogitsWarper(p)(None, logits.clone())
        assert torch.equal(ours.isinf(), hf.isinf())
    t = TemperatureLogitsWarper(0.7)(None, logits.clone())
    hf = TopPLogitsWarper(0.8)(None, TopKLogitsWarper(10)(None, t))
    # the warpers a sampling generation runs, in their order
    cfg = GenerationConfig(max_new_tokens=1, do_sample=True, temperature=0.7, top_k=10, top_p=0.8)
    ours = Pipeline(cfg, Context(0, 1, [])).scores(torch.zeros(6, 0, dtype=torch.long), logits)
    torch.testing.assert_close(ours, hf)


def test_sample_follows_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, NEG]]).expand(20000, 4)
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(sample(logits, g), minlength=4).float() / 20000
    want = torch.softmax(torch.tensor([0.0, 1.0, 2.0, NEG]), -1)
    assert counts[3] == 0
    assert torch.allclose(counts, want, atol=0.015)


def test_sampling_is_deterministic_under_a_seed():
    m = tiny_gpt("rope")
    x = torch.randint(0, 11, (3, 4))
    a = generate(m, x, 10, do_sample=True, temperature=1.5, seed=7)
    b = generate(m, x, 10, do_sample=True, temperature=1.5, generator=torch.Generator().manual_seed(7))
    c = generate(m, x, 10, do_sample=True, temperature=1.5, seed=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # top_k=1 sampling and temperature 0 are greedy
    greedy = generate(m, x, 10)
    assert torch.equal(generate(m, x, 10, do_sample=True, top_k=1, seed=3), greedy)
    assert torch.equal(generate(m, x, 10, do_sample=True, temperature=0.0, seed=3), greedy)


def test_num_return_sequences_with_sampling():
    m = tiny_gpt()
    x = torch.randint(0, 11, (2, 3))
    out = generate(m, x, 6, do_sample=True, num_return_sequences=3, seed=0)
    assert out.shape == (6, 9)
    assert torch.equal(out[:3, :3], x[:1].expand(3, 3)) and torch.equal(out[3:, :3], x[1:].expand(3, 3))


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
                                dict(num_beams=0), dict(do_sample=True, num_beams=2),
                                dict(num_return_sequences=2)])
def test_bad_options_are_clear_errors(kw):
    m = tiny_gpt()
    with pytest.raises(ValueError):
        generate(m, torch.zeros(1, 2, dtype=torch.long), 3, **kw)


def test_log_math_sanity():  # the hand case above relies on these probabilities
    assert math.isclose(sum([0.5, 0.3, 0.15, 0.05]), 1.0)


def test_a_temperature_below_the_minimum_decodes_greedily():
    """logits / 1e-40 overflow fp32 (NaN probabilities, a crash in the sampler): a temperature below
    MIN_TEMPERATURE decodes greedily, its limit, in generate() and in the engine alike."""
    from qkv.generate import GenerationConfig
    from qkv.generate.config import MIN_TEMPERATURE
    from qkv.generate.engine import Engine

    torch.manual_seed(0)
    model = tiny_gpt()
    ids = torch.randint(0, 11, (1, 5))
    greedy = generate(model, ids, 12)
    for t in (1e-40, 1e-45, MIN_TEMPERATURE / 2):
        tiny = generate(model, ids, GenerationConfig(max_new_tokens=12, do_sample=True, temperature=t))
        assert torch.equal(tiny, greedy)
        engine = Engine(model, block_size=4, max_new_tokens=12)
        rid = engine.add_request(ids[0], do_sample=True, temperature=t, seed=3)
        assert engine.run()[rid] == greedy[0, 5:].tolist()
    assert GenerationConfig(do_sample=True, temperature=MIN_TEMPERATURE).sampling  # the line itself samples
