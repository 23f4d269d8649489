"""qkv serve under requests that used to hurt it: a near-zero temperature, seeds past 64 bits, OpenAI fields
the server does not implement, a default max_tokens the KV pool cannot hold, a slow tokenizer, and an engine
that dies mid-stream. Each against a server on a loopback port, checked with raw httpx or the official openai
client."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
import torch
from _servehelpers import running_server, sse_events

from qkv.generate import generate
from qkv.serve import load_served


def test_tiny_temperature_big_seed_and_unsupported_fields(run_folder):
    served = load_served(run_folder)
    ok = {"model": served.name, "prompt": "ab", "max_tokens": 6}
    with running_server(run_folder, block_size=4) as (url, app):
        greedy = httpx.post(url + "/v1/completions", json={**ok, "temperature": 0}, timeout=60).json()
        for t in (1e-45, 1e-38, 1e-6):  # greedy, and the engine keeps running
            r = httpx.post(url + "/v1/completions", json={**ok, "temperature": t, "seed": 1}, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy["choices"][0]["text"]
        assert app.state.api.worker.alive
        for seed in (2 ** 64, -(2 ** 63) - 1):
            for stream in (False, True):
                r = httpx.post(
                    url + "/v1/completions", json={**ok, "seed": seed, "stream": stream}, timeout=60
                )
                assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
        for seed in (2 ** 64 - 1, -(2 ** 63)):
            assert (
                httpx.post(url + "/v1/completions", json={**ok, "seed": seed}, timeout=60).status_code == 200
            )
        # a character LM has no Hugging Face tokenizer for a grammar; tools are chat's
        refused = [("response_format", {"type": "json_object"}), ("suffix", "x"),
                   ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto")]
        for name, value in refused:
            r = httpx.post(url + "/v1/completions", json={**ok, name: value}, timeout=60)
            assert r.status_code == 400, (name, value, r.text)
            assert r.json()["error"]["code"] == "unsupported" and r.json()["error"]["param"] == name
        accepted = [
            ("logit_bias", {}),
            ("logit_bias", None),
            ("response_format", {"type": "text"}),
            ("suffix", ""),
            ("tools", []),
            ("tool_choice", "none"),
            ("logprobs", None),
            ("echo", False),
            ("logit_bias", {"5": 100}),
            ("logprobs", 0),
            ("logprobs", 2),
            ("echo", True),
        ]
        for name, value in accepted:
            r = httpx.post(url + "/v1/completions", json={**ok, name: value}, timeout=60)
            assert r.status_code == 200, (name, value, r.text)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="logit_bias"):  # an id past the vocabulary
            client.completions.create(model=served.name, prompt="ab", max_tokens=3, logit_bias={"100000": 1})


def test_default_max_tokens_fits_the_kv_pool(run_folder):
    """Without max_tokens the answer is as long as the pool allows (4 blocks of 4 = 16 positions, below the
    context of 64), not a 400 about a max_tokens the client never sent."""
    served = load_served(run_folder)
    prompt = "abcdefghij"
    n_prompt = len(served.codec.encode(prompt))
    with running_server(run_folder, block_size=4, num_blocks=4) as (url, app):
        r = httpx.post(
            url + "/v1/completions",
            json={"model": served.name, "prompt": prompt, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        room = 4 * 4 - n_prompt + 1  # the last new token is never written to the cache
        assert room < 16  # the completions default (16) would not have fit
        assert body["usage"]["completion_tokens"] == room and body["choices"][0]["finish_reason"] == "length"
        ref = generate(served.model, torch.tensor([served.codec.encode(prompt)]), room)[0, n_prompt:].tolist()
        assert body["choices"][0]["text"] == served.codec.decode(ref)
        # asked for explicitly, the same length over the pool is still refused before any block is taken
        r = httpx.post(
            url + "/v1/completions",
            json={"model": served.name, "prompt": prompt, "max_tokens": room + 1},
            timeout=60,
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_include_usage_puts_usage_on_its_own_last_chunk_only(run_folder):
    served = load_served(run_folder)
    body = {"model": served.name, "prompt": "ab", "max_tokens": 5, "temperature": 0, "stream": True}
    with running_server(run_folder, block_size=4) as (url, app):
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            json={**body, "stream_options": {"include_usage": True}},
            timeout=60,
        ) as r:
            events, done = sse_events(r.iter_lines())
        assert done and events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
        assert all(e.get("usage") is None for e in events[:-1])  # OpenAI's form: a client may add them up
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        chunks = list(client.completions.create(model=served.name, prompt="ab", max_tokens=5, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert sum(c.usage.completion_tokens for c in chunks if c.usage) == 5


def test_a_slow_tokenizer_does_not_stall_the_event_loop(run_folder):
    """A prompt is tokenized off the event loop: while one request's encode is held, /health still answers."""
    served = load_served(run_folder)
    with running_server(run_folder, block_size=4) as (url, app):
        codec = app.state.api.served.codec
        encode, entered, release = codec.encode, threading.Event(), threading.Event()

        def held(text):
            if text == "held":
                entered.set()
                release.wait(60)
            return encode(text)

        codec.encode = held
        out = {}
        th = threading.Thread(
            target=lambda: out.setdefault(
                "r",
                httpx.post(
                    url + "/v1/completions",
                    json={"model": served.name, "prompt": "held", "max_tokens": 2},
                    timeout=60,
                ),
            )
        )
        th.start()
        try:
            assert entered.wait(30)
            # would time out on a blocked loop
            assert httpx.get(url + "/health", timeout=10).status_code == 200
        finally:
            release.set()
            th.join(60)
        assert out["r"].status_code == 200


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the injected failure
def test_an_engine_that_dies_mid_stream(run_folder):
    """The stream ends with an error event and [DONE] (its status line went out long ago), later requests get
    a 503 that says why, /health is 503, and the worker's on_error hook (qkv serve: stop the process) runs
    once."""
    served = load_served(run_folder)
    with running_server(run_folder, block_size=4) as (url, app):
        api = app.state.api
        engine, calls, seen = api.engine, [0], []
        step = engine.step

        def failing_step():
            calls[0] += 1
            if calls[0] > 3:
                raise RuntimeError("injected failure")
            return step()

        engine.step = failing_step
        api.worker.on_error = seen.append
        body = {"model": served.name, "prompt": "ab", "max_tokens": 20, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            events, done = sse_events(r.iter_lines())
        assert done and "error" in events[-1] and "injected failure" in events[-1]["error"]["message"]
        assert events[-1]["error"]["code"] == "engine_error"
        assert len(seen) == 1 and "injected failure" in str(seen[0])
        r = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert "injected failure" in r.json()["error"]["message"]
        assert httpx.get(url + "/health", timeout=10).status_code == 503


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the injected failure
def test_qkv_serve_stops_with_status_1_when_its_engine_dies(run_folder, monkeypatch, capsys):
    """serve() (what `qkv serve` runs) ends, returning 1 and saying why, once the engine thread has died."""
    from qkv.generate.engine import Engine
    from qkv.serve import serve

    def broken_step(self):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(Engine, "step", broken_step)
    result = {}
    # a daemon thread: were the server never to stop, the test fails below and the thread dies with the
    # process
    th = threading.Thread(target=lambda: result.setdefault("status", serve(run_folder, port=0, name="lm")),
                          daemon=True)
    th.start()
    out = ""
    for _ in range(600):
        out += capsys.readouterr().out
        if "http://127.0.0.1:" in out:
            break
        th.join(0.05)
    base = out.split("at ")[1].split()[0]
    r = httpx.post(base + "/completions", json={"model": "lm", "prompt": "ab", "max_tokens": 3}, timeout=30)
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    th.join(60)
    assert not th.is_alive() and result["status"] == 1
    assert "the engine failed (RuntimeError: injected failure)" in capsys.readouterr().err


def test_a_completion_keeps_the_space_before_its_first_word(llama_sp):
    """A SentencePiece-style folder: /v1/completions' text is what the prompt's continuation adds to the
    decoded prompt (" con ar" after "Hello"), streamed or not, as transformers' decode of the whole output has
    it."""
    folder, tok, model = llama_sp
    served = load_served(folder)
    with running_server(folder, block_size=4) as (url, app):
        for prompt in ("Hello", "The class of"):
            ids = tok.encode(prompt).ids
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                     pad_token_id=2)[0].tolist()
            want = tok.decode(out, skip_special_tokens=True)[len(prompt):]
            assert want.startswith(" ") and want.strip()
            body = {"model": served.name, "prompt": prompt, "max_tokens": 6, "temperature": 0}
            whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
            assert whole["choices"][0]["text"] == want
            with httpx.stream(
                "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60
            ) as r:
                events, done = sse_events(r.iter_lines())
            assert done and "".join(e["choices"][0]["text"] for e in events) == want


def test_repetition_penalty_is_honoured(run_folder):
    """vLLM's extension: a request's repetition_penalty equals generate()'s with the same setting."""
    served = load_served(run_folder)
    ids = served.codec.encode("abab")
    with running_server(run_folder, block_size=4) as (url, app):
        body = {
            "model": served.name,
            "prompt": "abab",
            "max_tokens": 12,
            "temperature": 0,
            "repetition_penalty": 3.0,
        }
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        ref = generate(served.model, torch.tensor([ids]), 12, repetition_penalty=3.0)[0, len(ids):].tolist()
        plain = generate(served.model, torch.tensor([ids]), 12)[0, len(ids):].tolist()
        assert ref != plain  # the penalty changes this continuation: the comparison means something
        assert r.json()["choices"][0]["text"] == served.codec.decode(ref)
        for bad in (0, -1, 11, "x", 1e-300, 0.009):
            r = httpx.post(url + "/v1/completions", json={**body, "repetition_penalty": bad}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"


def test_a_request_whose_sampling_fails_fails_alone_and_the_server_goes_on(run_folder):
    """A request whose settings make its probabilities NaN (a repetition_penalty of 1e-300 let past the
    checks: the API refuses it, above) gets a 500 naming the failure, streamed or not; the engine thread lives
    on and the next request is still answered (the server keeps running)."""
    served = load_served(run_folder)
    body = {"model": served.name, "prompt": "abab", "max_tokens": 6, "temperature": 1.0, "seed": 0}
    with running_server(run_folder, block_size=4) as (url, app):
        api = app.state.api
        r = httpx.post(url + "/v1/completions", json={**body, "repetition_penalty": 1e-300}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"
        options = api.options
        api.options = lambda *a: {**options(*a), "repetition_penalty": 1e-300}  # past the API's checks
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed", r.text
        assert "sampling failed" in r.json()["error"]["message"]
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            events, done = sse_events(s.iter_lines())
        assert done and events[-1]["error"]["code"] == "request_failed"
        api.options = options
        assert api.worker.alive and httpx.get(url + "/health", timeout=10).status_code == 200
        r = httpx.post(url + "/v1/completions", json={**body, "temperature": 0}, timeout=60)
        ids = served.codec.encode("abab")
        ref = generate(served.model, torch.tensor([ids]), 6)[0, len(ids):].tolist()
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == served.codec.decode(ref)


HOSTILE_TEMPLATE = (
    "{% if messages[0]['content'] == 'loop' %}{% for i in range(100000) %}"
    "{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif messages[0]['content'] == 'big' %}{{ 'x' * 3000000000 }}"
    "{% elif messages[0]['content'] == 'include' %}{% include 'other.jinja' %}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_a_chat_template_past_its_limits_is_a_400_and_the_server_goes_on(gpt2_folder, tmp_path, monkeypatch):
    """A template that loops for hours, allocates gigabytes or includes a file answers 400 naming the template
    (it hung the server, died with a MemoryError, or answered 500), and the next request is served."""
    import json
    import shutil

    from qkv.interop import chat_sandbox

    monkeypatch.setattr(chat_sandbox, "MAX_SECONDS", 0.5)
    folder = tmp_path / "hostile"
    shutil.copytree(gpt2_folder, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HOSTILE_TEMPLATE}))
    with running_server(folder, block_size=4) as (url, app):
        name = app.state.api.served.name
        for content, why in (("loop", "took longer than 0.5 s"), ("big", "over the size limit"),
                             ("include", "includes, imports or extends 'other.jinja'")):
            r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": name, "max_tokens": 2, "messages": [{"role": "user", "content": content}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            assert f"chat template of {folder}" in r.json()["error"]["message"] and why in r.text
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": name, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 200, r.text


def test_a_lone_surrogate_is_a_400_naming_its_field(gpt2_folder):
    body = '{"model": "%s", "max_tokens": 2, %s}'
    with running_server(gpt2_folder, block_size=4) as (url, app):
        name = app.state.api.served.name
        for path, field in (
            ("/v1/completions", '"prompt": "hi \\ud800 there"'),
            ("/v1/chat/completions", '"messages": [{"role": "user", "content": "hi \\udfff"}]'),
        ):
            r = httpx.post(url + path, content=body % (name, field), timeout=60,
                           headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == field.split('"')[1] and "lone surrogate" in r.text
        assert httpx.post(url + "/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2},
                          timeout=60).status_code == 200


def test_a_client_that_sends_part_of_a_body_costs_one_log_line(run_folder):
    """A client that disconnects mid-body: one warning line each, not uvicorn's "Exception in ASGI
    application" traceback; and GET /v1/models says when the model was loaded (it said "created": 0)."""
    import logging
    import socket
    import time

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("uvicorn.error")
    try:
        with running_server(run_folder, block_size=4) as (url, app):
            logger.addHandler(handler)  # after uvicorn has configured its loggers
            host, port = url.removeprefix("http://").split(":")
            for _ in range(3):
                with socket.create_connection((host, int(port))) as s:
                    s.sendall(
                        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b'Content-Length: 200\r\n\r\n{"model": '
                    )
                    time.sleep(0.2)
            time.sleep(0.5)
            created = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["created"]
            assert abs(created - time.time()) < 600
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if r.exc_info or "Exception in ASGI" in r.getMessage()]
    assert len([r for r in records if "went away" in r.getMessage()]) == 3
