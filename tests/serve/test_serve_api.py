"""qkv serve end to end: the official openai client and raw httpx (SSE) against a server on an ephemeral
loopback port; every greedy answer equals generate() run alone on the same prompt."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from _servehelpers import running_server

from qkv.generate import generate
from qkv.serve import load_served


def _alone(served, ids, n):
    """The reference: generate() on this prompt alone, greedy, stopping at the served eos ids."""
    eos = sorted(served.codec.eos_ids) or None
    return generate(served.model, torch.tensor([ids]), n, eos_token_id=eos)[0, len(ids):].tolist()  # one row


def _sse(lines):
    """The JSON payloads of an SSE stream, and whether it ended with [DONE]."""
    events, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            break
        events.append(json.loads(data))
    return events, done


def test_openai_client_concurrent_greedy_equals_generate(gpt2_folder):
    served = load_served(gpt2_folder)
    prompts = ["The class", "def f(x):\n    return", "import", "An object is", "for i in range", "x"]
    with running_server(gpt2_folder, block_size=4, max_batch_size=4) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        name = served.name
        assert [m.id for m in client.models.list().data] == [name]
        with ThreadPoolExecutor(6) as pool:
            res = list(pool.map(lambda p: client.completions.create(model=name, prompt=p, max_tokens=12,
                                                                   temperature=0), prompts))
        for p, r in zip(prompts, res):
            ids = served.codec.encode(p)
            ref = _alone(served, ids, 12)
            assert r.choices[0].text == served.codec.decode(ref)
            assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref)
            assert r.choices[0].finish_reason == ("stop" if len(ref) < 12 else "length")
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a class?"}]
        chat = client.chat.completions.create(model=name, messages=msgs, max_tokens=10, temperature=0)
        ids = served.codec.chat_prompt(msgs)
        assert chat.choices[0].message.content == served.codec.decode(_alone(served, ids, 10))
        assert chat.usage.prompt_tokens == len(ids)
        # streamed through the client: the same text
        pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=name, messages=msgs, max_tokens=10, temperature=0, stream=True) if c.choices]
        assert "".join(pieces) == chat.choices[0].message.content
        assert app.state.api.engine.stats()["prefix_hit_tokens"] > 0  # the repeated chat prompt was cached


def test_sse_stream_and_usage_on_a_run_folder(run_folder):
    served = load_served(run_folder)
    with running_server(run_folder, block_size=4) as (url, _):
        body = {"model": served.name, "prompt": "ROMEO: ", "max_tokens": 20, "temperature": 0}
        whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events, done = _sse(r.iter_lines())
        assert done and events[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
        assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]
        assert events[-1]["usage"] == whole["usage"] and whole["usage"]["completion_tokens"] == 20
        ref = _alone(served, served.codec.encode("ROMEO: "), 20)
        assert whole["choices"][0]["text"] == served.codec.decode(ref)
        # a stop string ends the text before it (and is not part of it)
        text = whole["choices"][0]["text"]
        stop = text[5:7]
        if stop and stop not in text[:5]:
            cut = httpx.post(url + "/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()
            assert cut["choices"][0]["text"] == text[:text.find(stop)]
            assert cut["choices"][0]["finish_reason"] == "stop"


def test_clients_that_disconnect_mid_stream_give_their_blocks_back(gpt2_folder):
    served = load_served(gpt2_folder)
    with running_server(gpt2_folder, block_size=4, max_batch_size=16) as (url, app):
        engine = app.state.api.engine
        body = {
            "model": served.name,
            "prompt": "The class",
            "max_tokens": 80,
            "temperature": 0.9,
            "stream": True,
        }

        def leave_early(i):
            with httpx.stream("POST", url + "/v1/completions", json={**body, "seed": i}, timeout=60) as r:
                for n, _line in enumerate(r.iter_lines()):
                    if n >= 4:
                        return True  # the with-block closes the connection mid-stream
            return False

        with ThreadPoolExecutor(10) as pool:
            assert all(pool.map(leave_early, range(10)))
        deadline = time.monotonic() + 20
        while app.state.api.worker.stats["cancelled"] < 10 or engine.stats()["blocks_used"]:
            assert time.monotonic() < deadline, app.state.api.worker.stats
            time.sleep(0.05)
        st = app.state.api.worker.stats
        assert st["cancelled"] == 10 and st["running"] == 0 and st["blocks_used"] == 0
        assert app.state.api.active == 0
        metrics = httpx.get(url + "/metrics").text
        assert 'qkv_requests_total{finish_reason="cancelled"} 10.0' in metrics


def _post(url, body, raw=None):
    r = httpx.post(url + "/v1/completions", content=raw if raw is not None else json.dumps(body),
                   headers={"content-type": "application/json"}, timeout=60)
    return r.status_code, r.json()


def test_errors_have_openai_shape_and_do_not_disturb_others(run_folder):
    served = load_served(run_folder)
    ok = {"model": served.name, "prompt": "ab", "max_tokens": 4}
    with running_server(run_folder, block_size=4) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        long_body = {**ok, "max_tokens": 40, "temperature": 0, "stream": True}
        results = {}

        def long_request():
            with httpx.stream("POST", url + "/v1/completions", json=long_body, timeout=60) as r:
                results["long"] = _sse(r.iter_lines())

        th = threading.Thread(target=long_request)
        th.start()
        cases = [
            (None, "{not json", 400, None),
            ({**ok, "max_tokens": "4"}, None, 400, "max_tokens"),
            ({**ok, "max_tokens": 0}, None, 400, "max_tokens"),
            ({**ok, "temperature": -0.5}, None, 400, "temperature"),
            ({**ok, "top_p": 0}, None, 400, "top_p"),
            ({**ok, "top_p": 1.5}, None, 400, "top_p"),
            ({**ok, "n": 129}, None, 400, "n"),
            ({**ok, "stream": "yes"}, None, 400, "stream"),
            ({**ok, "model": "gpt-4"}, None, 404, "model"),
            ({**ok, "prompt": ""}, None, 400, "prompt"),
            ({**ok, "prompt": [10 ** 6]}, None, 400, "prompt"),
            ({**ok, "prompt": "a" * 60, "max_tokens": 10}, None, 400, "max_tokens"),  # context 64
            ({**ok, "prompt": "a" * 70}, None, 400, "prompt"),
        ]
        for body, raw, status, param in cases:
            code, err = _post(url, body, raw)
            assert code == status, (body, err)
            assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
            assert err["error"]["param"] == param and err["error"]["message"]
        assert app.state.api.worker.stats["blocks_used"] <= 40  # over-context requests took nothing
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.completions.create(model=served.name, prompt="ab", temperature=-1)
        with pytest.raises(openai.BadRequestError, match="chat template"):
            client.chat.completions.create(model=served.name, messages=[{"role": "user", "content": "hi"}])
        r = httpx.post(url + "/v1/chat/completions", json={"model": served.name, "messages": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = httpx.get(url + "/v1/engines")
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        th.join(60)
        events, done = results["long"]
        assert done and events[-1]["usage"]["completion_tokens"] == 40  # untouched by the bad requests
        ref = _alone(served, served.codec.encode("ab"), 40)
        assert "".join(e["choices"][0]["text"] for e in events) == served.codec.decode(ref)
        h = httpx.get(url + "/health")
        assert h.status_code == 200 and h.json() == {"status": "ok"}
        m = httpx.get(url + "/metrics").text
        for name in (
            "qkv_num_requests_running",
            "qkv_kv_blocks_used",
            "qkv_generation_tokens_total",
            "qkv_prefix_cache_hit_rate",
            "qkv_preemptions_total",
            "qkv_time_to_first_token_seconds_bucket",
        ):
            assert name in m


def test_full_queue_answers_429_with_retry_after(run_folder):
    from qkv.serve import ServeConfig

    served = load_served(run_folder)
    with running_server(run_folder, settings=ServeConfig(max_waiting=0), max_batch_size=1) as (url, app):
        engine = app.state.api.engine
        step = engine.step
        engine.step = lambda: (time.sleep(0.05), step())[1]  # a slow model: the first request stays running
        body = {"model": served.name, "prompt": "ab", "max_tokens": 20, "stream": True, "temperature": 0}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()  # kept: a dropped iterator closes the connection (the server cancels)
            next(lines)  # the first request holds the only place
            second = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=60)
            assert second.status_code == 429 and second.headers["retry-after"] == "1"
            assert second.json()["error"]["type"] == "rate_limit_error"
            _, done = _sse(lines)
            assert done
        assert (
            httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=60).status_code == 200
        )


def test_qkv_serve_command_takes_max_model_len_and_exits_0_on_sigterm(run_folder):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "qkv.cli.main", "serve", str(run_folder), "--port", "0",
                          "--name", "lm", "--max-model-len", "32"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline()
        assert "http://127.0.0.1:" in line, line + p.stderr.read()
        base = line.split("at ")[1].split()[0]
        model = httpx.get(base + "/models", timeout=30).json()["data"][0]
        assert model["id"] == "lm" and model["max_model_len"] == 32  # --max-model-len, below the model's 64
        r = httpx.post(
            base + "/completions", json={"model": "lm", "prompt": "x", "max_tokens": 3}, timeout=30
        )
        assert r.status_code == 200
        r = httpx.post(
            base + "/completions", json={"model": "lm", "prompt": "x" * 20, "max_tokens": 20}, timeout=30
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
