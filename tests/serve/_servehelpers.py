"""The server the tests start: uvicorn in a thread of the test process, on an ephemeral loopback port
(a module with its own name: `from conftest import` would be ambiguous beside other test folders'
conftest)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import openai

from qkv.serve import ServeConfig, build_engine, create_app, load_served


@contextmanager
def running_server(
    folder, *, settings: ServeConfig | None = None, shutdown_timeout: float = 5, **engine_options
):
    """(base url, app) of a server on 127.0.0.1:<free port>; stopped (and its engine thread) on exit. The
    uvicorn server is app.state.server (a test may stop it early: server.should_exit = True)."""
    served = load_served(folder)
    engine = build_engine(served, **engine_options)
    with running_app(create_app(served, engine, settings), shutdown_timeout) as out:
        yield out


@contextmanager
def running_app(app, shutdown_timeout: float = 5):
    """(base url, app) of any app (an embeddings server's too) served on 127.0.0.1:<free port>."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=shutdown_timeout)
    )
    app.state.server = server
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def sse_events(lines) -> tuple[list[dict], bool]:
    """(payloads, ended with [DONE]) of an SSE stream's lines."""
    events, done = [], False
    for line in lines:
        if line.startswith("data: "):
            if line == "data: [DONE]":
                done = True
                break
            events.append(json.loads(line[len("data: "):]))
    return events, done


def greedy_completions(url: str, name: str, prompts: Sequence[str], max_tokens: Sequence[int],
                       stream: bool) -> list[str]:
    """Each prompt's greedy completion (temperature 0, its max_tokens) through the official openai client,
    all sent at once (so the engine batches them); streamed answers are joined."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)

    def one(args):
        prompt, n = args
        if not stream:
            return client.completions.create(model=name, prompt=prompt, max_tokens=n, temperature=0
                                             ).choices[0].text
        chunks = client.completions.create(model=name, prompt=prompt, max_tokens=n, temperature=0,
                                           stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, zip(prompts, max_tokens)))
