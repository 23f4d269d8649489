"""qkv serve with --speculative prompt-lookup (EngineConfig.speculative): through the official openai client
on a loopback port, a concurrent batch of prompts of different lengths, some repeating themselves (drafts
accepted), streamed and not, answers exactly as the server without speculation and generate() alone
(greedy); a request's own prompt_lookup_num_tokens (an extension field) likewise; the acceptance is
reported in the engine's stats and /metrics."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from _servehelpers import greedy_completions, running_server

import qkv.serve
from qkv.cli.main import main
from qkv.generate import generate
from qkv.serve import load_served

PROMPTS = ["def f(x):\n    return x\ndef f(x):\n    return x\ndef f(x):\n", "The class", "import",
           "An object is an object is an object is", "for i in range(10): for i in range(10): for i in",
           "x"]
MAX_TOKENS = (24, 16, 20, 24, 18, 12)


def test_speculative_server_answers_as_plain_server_and_generate(gpt2_folder):
    served = load_served(gpt2_folder)
    eos = sorted(served.codec.eos_ids) or None
    want = []
    for p, n in zip(PROMPTS, MAX_TOKENS):
        ids = served.codec.encode(p)
        want.append(served.codec.decode(
            generate(served.model, torch.tensor([ids]), n, eos_token_id=eos)[0, len(ids):].tolist()))
    with running_server(gpt2_folder, block_size=4, max_batch_size=4) as (url, app):
        assert greedy_completions(url, served.name, PROMPTS, MAX_TOKENS, stream=False) == want
        assert app.state.api.engine.stats()["spec_draft_tokens"] == 0
        # one request's own speculation (an extension field, as top_k): the same answer
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        one = client.completions.create(model=served.name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS[0],
                                        temperature=0, extra_body={"prompt_lookup_num_tokens": 3})
        assert one.choices[0].text == want[0] and app.state.api.engine.stats()["spec_accepted_tokens"] > 0
        for bad in (0, 65):
            r = httpx.post(url + "/v1/completions", json={"model": served.name, "prompt": "x",
                                                          "prompt_lookup_num_tokens": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_lookup_num_tokens"
    with running_server(gpt2_folder, block_size=4, max_batch_size=4, speculative="prompt-lookup",
                        speculative_tokens=4) as (url, app):
        assert greedy_completions(url, served.name, PROMPTS, MAX_TOKENS, stream=False) == want
        assert greedy_completions(url, served.name, PROMPTS, MAX_TOKENS, stream=True) == want
        msgs = [{"role": "user", "content": "x = 1\nx = 1\nx = 1\nx ="}]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        chat = client.chat.completions.create(model=served.name, messages=msgs, max_tokens=16, temperature=0)
        ids = served.codec.chat_prompt(msgs)
        ref = generate(served.model, torch.tensor([ids]), 16, eos_token_id=eos)[0, len(ids):].tolist()
        assert chat.choices[0].message.content == served.codec.decode(ref)
        stats = app.state.api.engine.stats()
        assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
        metrics = httpx.get(url + "/metrics").text
        assert f"qkv_spec_decode_accepted_tokens_total {float(stats['spec_accepted_tokens'])}" in metrics


def test_the_flags_reach_serve(monkeypatch, tmp_path, capsys):
    seen = {}
    monkeypatch.setattr(qkv.serve, "serve", lambda model, **kw: seen.update(kw) or 0)
    assert main(["serve", str(tmp_path), "--speculative", "prompt-lookup", "--speculative-tokens", "4"]) == 0
    assert seen == {"speculative": "prompt-lookup", "speculative_tokens": 4}
    seen.clear()  # a draft model folder (loaded by serve: tests/serve/test_serve_draft.py)
    assert main(["serve", str(tmp_path), "--speculative", str(tmp_path / "draft")]) == 0
    assert seen == {"speculative": str(tmp_path / "draft")}
    assert "prompt-lookup|MODEL" in _help(capsys)


def _help(capsys) -> str:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    return capsys.readouterr().out
