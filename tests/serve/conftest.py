"""Fixtures for the server tests: tiny folders built here (never downloaded) and a server on an ephemeral
loopback port, run by uvicorn in a thread of the test process."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager

import pytest

from qkv.serve import ServeSettings, build_engine, create_app, load_served

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="session")
def run_folder(tmp_path_factory):
    """A qkv run folder: a tiny character LM (task.json + tokenizer + random model), no training."""
    from qkv.tasks import build_task

    path = tmp_path_factory.mktemp("run")
    task = build_task("charlm", family="gpt", context=64)
    model = task.build_model("gpt-nano", d_model=32, n_heads=2, n_layers=2, position="learned", init_std=0.3)
    task.save(path)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def gpt2_folder(tmp_path_factory):
    """A Hugging Face GPT-2 folder: a byte-level BPE tokenizer trained on stdlib text, a chat template,
    random transformers weights, all saved here."""
    import pydoc_data.topics

    import transformers
    from tokenizers import ByteLevelBPETokenizer

    path = tmp_path_factory.mktemp("gpt2")
    texts = list(pydoc_data.topics.topics.values())[:40]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=400, min_frequency=2,
                            special_tokens=["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"])
    bpe.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>", "chat_template": CHAT_TEMPLATE}))
    V = bpe.get_vocab_size()
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=96, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=4, initializer_range=0.3)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(path)
    return path


@contextmanager
def running_server(folder, *, settings: ServeSettings | None = None, **engine_options):
    """(base url, app) of a server on 127.0.0.1:<free port>; stopped (and its engine thread) on exit."""
    import uvicorn

    served = load_served(folder)
    engine = build_engine(served, **engine_options)
    app = create_app(served, engine, settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
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
