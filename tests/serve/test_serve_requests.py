"""The request bodies (qkv.serve.requests) without a server: each sampling field accepts exactly what
GenerationConfig's own rule accepts (its bounds are read from GenerationConfig's field metadata, not written
again), except where OpenAI's convention is stated (OPENAI_RULES); to_generation_config() gives the engine's
settings; an error names the field and says its bounds in GenerationConfig's words."""

from __future__ import annotations

import dataclasses

import pytest

from qkv.config import ConfigError, bounds_text
from qkv.generate.config import GenerationConfig
from qkv.serve.errors import APIError
from qkv.serve.requests import OPENAI_RULES, ChatCompletionRequest, CompletionRequest, parse

BASE = {"model": "m", "prompt": "ab"}
VALUES = [-2, -1, -0.5, 0, 1e-9, 0.009, 0.01, 0.5, 1, 1.0001, 2, 2.5, 10, 11, 2 ** 63, 2 ** 64]


def accepted(**body) -> bool:
    try:
        parse({**BASE, **body}, chat=False)
    except APIError as e:
        assert e.status == 400 and e.param == next(iter(body)), e.message
        return False
    return True


def config_accepts(**setting) -> bool:
    try:
        GenerationConfig(**setting)
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("name", ["top_p", "min_p"])
def test_a_field_without_an_openai_rule_takes_exactly_what_generation_config_takes(name):
    assert name not in OPENAI_RULES
    verdicts = [(v, accepted(**{name: v})) for v in VALUES]
    assert [ok for _, ok in verdicts] == [config_accepts(**{name: v}) for v in VALUES]
    assert any(ok for _, ok in verdicts) and not all(ok for _, ok in verdicts)  # the grid tells them apart


def test_openai_rules_are_the_only_differences():
    ints = [v for v in VALUES if isinstance(v, int)]
    assert [accepted(temperature=v) for v in VALUES] == [config_accepts(temperature=v) and v <= 2
                                                         for v in VALUES]
    assert [accepted(top_k=v) for v in ints] == [v == -1 or config_accepts(top_k=v) for v in ints]
    assert [accepted(max_tokens=v) for v in ints] == [config_accepts(max_new_tokens=v) and v >= 1
                                                      for v in ints]
    assert [accepted(repetition_penalty=v) for v in VALUES] == [
        config_accepts(repetition_penalty=v) and 0.01 <= v <= 10 for v in VALUES]
    assert [accepted(seed=v) for v in ints] == [-(2 ** 63) <= v < 2 ** 64 for v in ints]
    # n follows num_return_sequences' rule (>= 1) and then the server's bound (checks.py: max_batch_size too)
    assert [accepted(n=v) for v in (0, 1, 2, 128, 129)] == [False, True, True, True, False]
    # OpenAI's penalties: GenerationConfig's [-2, 2]
    for name in ("presence_penalty", "frequency_penalty"):
        assert [accepted(**{name: v}) for v in VALUES] == [config_accepts(**{name: v}) for v in VALUES]
    assert [accepted(max_tokens=0, echo=e) for e in (False, True)] == [False, True]


def test_a_changed_bound_in_generation_config_is_the_apis_bound(monkeypatch):
    """The API's fields read GenerationConfig's metadata: change top_p's there, and a field made from it
    follows."""
    import pydantic

    from qkv.serve.requests import describe, setting

    top_p = {f.name: f for f in dataclasses.fields(GenerationConfig)}["top_p"]
    monkeypatch.setattr(top_p, "metadata", {**top_p.metadata, "le": 0.5})
    body = pydantic.create_model("Body", top_p=(float, setting("top_p")))
    body.model_validate({"top_p": 0.5})
    with pytest.raises(pydantic.ValidationError):
        body.model_validate({"top_p": 0.7})
    assert describe("top_p") == "in (0, 0.5]"


def test_an_error_says_the_bounds_in_generation_configs_words():
    fields = {f.name: f for f in dataclasses.fields(GenerationConfig)}
    with pytest.raises(APIError) as e:
        parse({**BASE, "top_p": 1.5}, chat=False)
    assert e.value.param == "top_p" and bounds_text(fields["top_p"].metadata) in e.value.message
    with pytest.raises(APIError, match="'top_k' must be an integer at least -1 .-1 or 0 = off., got -2"):
        parse({**BASE, "top_k": -2}, chat=False)
    with pytest.raises(APIError, match=r"'max_tokens' must be an integer at least 1, got \"4\""):
        parse({**BASE, "max_tokens": "4"}, chat=False)


def test_to_generation_config():
    req = parse({**BASE, "temperature": 0, "top_k": -1, "stop": "x", "max_tokens": 3}, chat=False)
    assert isinstance(req, CompletionRequest)
    cfg = req.to_generation_config({"top_k": 5, "repetition_penalty": 1.5})
    # temperature 0: greedy (GenerationConfig's rule); -1: no top-k; left out: the defaults given
    assert not cfg.sampling and cfg.top_k == 0 and cfg.repetition_penalty == 1.5
    assert cfg.stop_strings == ["x"] and cfg.max_new_tokens == 3
    cfg = parse({**BASE, "temperature": 0.7}, chat=False).to_generation_config(max_new_tokens=9)
    assert cfg.sampling and cfg.temperature == 0.7 and cfg.top_p == 1.0 and cfg.max_new_tokens == 9
    # every sampling setting explicit, "off" included, so the engine's base config cannot override it
    sampling = {"do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty"}
    assert sampling <= set(cfg.explicit())


def test_chat_bodies():
    text = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:,"}},
            {"type": "text", "text": "b"}]
    req = parse({"model": "m", "messages": [{"role": "user", "content": text}]}, chat=True)
    assert isinstance(req, ChatCompletionRequest)
    assert req.messages[0].text == "a\nb" and req.messages[0].images == ["data:,"]
    for content, code in ((None, "invalid_type"), ([{"type": "text"}], "invalid_type"),
                          ([{"type": "input_audio"}], "unsupported")):
        with pytest.raises(APIError) as e:
            parse({"model": "m", "messages": [{"role": "user", "content": content}]}, chat=True)
        assert e.value.param == "messages[0]" and e.value.code == code
