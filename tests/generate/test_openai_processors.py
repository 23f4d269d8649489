"""OpenAI's presence_penalty, frequency_penalty and logit_bias as logits processors (processors.py), checked
against their definitions written out here with a Python loop over each row's generated tokens, and through
generate() and the serving Engine."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from _genmodels import tiny_gpt

from qkv.config import ConfigError
from qkv.generate import GenerationConfig, Pipeline, generate
from qkv.generate.engine import Engine
from qkv.generate.processors import Context, LogitBias, PresenceFrequencyPenalty


def openai_penalised(scores, ids, start, presence, frequency):
    """OpenAI's definition: mu[j] -> mu[j] - c[j] * frequency - float(c[j] > 0) * presence, c[j] counting the
    generated tokens (after the prompt)."""
    out = scores.clone().double()
    for b in range(ids.shape[0]):
        for tok, c in Counter(ids[b, start:].tolist()).items():
            out[b, tok] -= c * frequency + (1.0 if c > 0 else 0.0) * presence
    return out


@pytest.mark.parametrize("presence,frequency", [(0.7, 0.0), (0.0, 1.3), (-1.5, 2.0)])
def test_presence_frequency_penalty_is_openais_definition(presence, frequency):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 9, (3, 12), generator=g)
    scores = torch.randn(3, 9, generator=g)
    p = PresenceFrequencyPenalty.from_config(
        GenerationConfig(presence_penalty=presence, frequency_penalty=frequency), Context(5, 10, []))
    torch.testing.assert_close(p(ids, scores).double(), openai_penalised(scores, ids, 5, presence, frequency))
    # the prompt's tokens do not count: nothing generated yet leaves the scores alone
    torch.testing.assert_close(p(ids[:, :5], scores), scores)


def test_penalties_off_build_no_processor():
    cfg = GenerationConfig(presence_penalty=0.0, frequency_penalty=0.0)
    assert PresenceFrequencyPenalty.from_config(cfg, Context(1, 1, [])) is None
    assert LogitBias.from_config(cfg, Context(1, 1, [])) is None


def test_logit_bias_adds_to_the_listed_ids_only():
    scores = torch.randn(2, 7)
    p = LogitBias({3: 5.0, 0: -100.0, 50: 1.0})  # 50: past this vocabulary, left alone
    want = scores.clone()
    want[:, 3] += 5
    want[:, 0] -= 100
    torch.testing.assert_close(p(torch.zeros(2, 1, dtype=torch.long), scores), want)


def test_generation_config_checks_logit_bias():
    assert GenerationConfig(logit_bias={"7": 2}).logit_bias == {7: 2.0}  # a JSON file's string keys
    assert GenerationConfig(logit_bias={}).logit_bias is None
    for bad in ({3: 101}, {3: float("nan")}, {-1: 1}, {"x": 1}, {3: True}):
        with pytest.raises(ConfigError, match="logit_bias"):
            GenerationConfig(logit_bias=bad)
    for name in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(ConfigError, match=name):
            GenerationConfig(**{name: 2.5})


def _greedy_reference(model, prompt, n, presence=0.0, frequency=0.0, bias=None):
    """Greedy decoding by full forwards, the penalties and bias applied by their definitions."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1:].double()
        logits = openai_penalised(logits, torch.tensor([ids]), len(prompt), presence, frequency)
        for t, b in (bias or {}).items():
            logits[0, t] += b
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def test_generate_and_engine_apply_them_as_defined():
    torch.manual_seed(0)
    model = tiny_gpt(vocab=13)
    prompt = [1, 2, 3, 4]
    settings = [dict(frequency_penalty=2.0), dict(presence_penalty=2.0, frequency_penalty=-0.5),
                dict(logit_bias={5: 3.0, 6: -100.0})]
    engine = Engine(model, block_size=4)
    for s in settings:
        ref = _greedy_reference(model, prompt, 10, s.get("presence_penalty", 0.0),
                                s.get("frequency_penalty", 0.0), s.get("logit_bias"))
        out = generate(model, torch.tensor([prompt]), GenerationConfig(max_new_tokens=10, **s))
        assert out[0, len(prompt):].tolist() == ref, s
        rid = engine.add_request(prompt, GenerationConfig(max_new_tokens=10, **s))
        engine.run()
        assert engine.pop_finished(rid)[0] == ref, s
    # +100 forces a token, -100 bans one
    out = generate(model, torch.tensor([prompt]), GenerationConfig(max_new_tokens=6, logit_bias={9: 100}))
    assert out[0, len(prompt):].tolist() == [9] * 6
    # an id past the vocabulary of 13 is refused, not ignored
    with pytest.raises(ValueError, match="logit_bias 13 is outside"):
        generate(model, torch.tensor([prompt]), GenerationConfig(max_new_tokens=2, logit_bias={13: 1}))
    with pytest.raises(ValueError, match="logit_bias 13 is outside"):
        engine.add_request(prompt, GenerationConfig(max_new_tokens=2, logit_bias={13: 1}))


def test_pipeline_order_puts_bias_before_the_bans():
    """A bias cannot lift a banned word: bad_words_ids runs after logit_bias."""
    cfg = GenerationConfig(logit_bias={2: 100.0}, bad_words_ids=[[2]])
    pipe = Pipeline(cfg, Context(1, 4, []))
    out = pipe.choose(torch.tensor([[0]]), torch.zeros(1, 5))
    assert out.item() != 2
