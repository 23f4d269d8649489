"""The server's life: load the model, build the engine, bind, serve until a signal, drain."""


from __future__ import annotations

import contextlib
import dataclasses
import signal
import socket
import sys
import threading
from collections.abc import Callable, Generator
from dataclasses import fields
from pathlib import Path
from typing import Any

import uvicorn

from qkv.config import ConfigError, suggest
from qkv.generate.config import GenerationConfig
from qkv.generate.engine import Engine
from qkv.generate.engine_config import PROMPT_LOOKUP, EngineConfig
from qkv.serve.app import create_app
from qkv.serve.config import ServeConfig
from qkv.serve.embeddings import create_embeddings_app, is_encoder_folder, load_embedder
from qkv.serve.model import Served, load_draft, load_served


def build_engine(served: Served, config: EngineConfig | None = None, **options: Any) -> Engine:
    """The Engine for a served model: the folder's token ids plus the tokenizer's eos ids as its base
    settings. `config` and `options` (EngineConfig's field names: block_size=4) are its EngineConfig;
    max_model_len None: the model's (configured) context; speculative a draft model folder: loaded here."""
    config = _configs(options, None, config, serving=False)[1]
    base = served.model.generation_defaults().get("eos_token_id")
    ids = set(served.codec.eos_ids) | ({base} if isinstance(base, int) else set(base or []))
    eos = sorted(i for i in ids if 0 <= i < served.model.output_vocab_size) or None
    # --speculative MODEL: the draft folder loaded as the served model was (refused before the server listens)
    draft = None if config.speculative in (None, PROMPT_LOOKUP) else load_draft(config.speculative, served)
    engine = Engine(served.model, config=config, tokenizer=served.codec, eos_token_id=eos, draft_model=draft)
    # of the folder's generation settings the engine's base keeps only the token ids: a request's sampling is
    # all the API's (app.py: the request's values, else the folder's five sampling defaults as vLLM takes
    # them, else OpenAI's), and the rest of a generation_config.json (no_repeat_ngram_size, bad_words_ids,
    # min_length, ...) is not part of OpenAI's API: applied unasked, no request could turn it off
    base = engine.cfg
    engine.cfg = GenerationConfig(eos_token_id=base.eos_token_id, pad_token_id=base.pad_token_id,
                                  bos_token_id=base.bos_token_id, bad_words_ids=_image_token_ban(served))
    return engine


def _image_token_ban(served: Served) -> list[list[int]] | None:
    """A vision-language model never generates its image placeholder (LLaVA.generation_defaults bans it
    too): images come with the prompt."""
    if served.images is None:
        return None
    c = served.model.config
    return [[c.image_token_id]] if c.image_token_id < served.model.output_vocab_size else None


class GracefulServer(uvicorn.Server):
    """uvicorn's server, but a SIGINT / SIGTERM ends a graceful shutdown with exit status 0 (uvicorn re-raises
    the signal after shutting down, which would kill the process with it), and calls on_exit at once (the
    app's shutting_down flag: _make_server)."""

    on_exit: Callable[[], None] | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if self.on_exit is not None:
            self.on_exit()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        old = {s: signal.signal(s, self.handle_exit) for s in sigs}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not listening yet); a clear error when it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    # a port in use, an address not of this machine, a name that does not resolve (gaierror)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(model: str | Path, config: ServeConfig | None = None, engine_config: EngineConfig | None = None,
          **options: Any) -> int:
    """Load MODEL, start the engine thread and serve until SIGINT / SIGTERM: then stop accepting, let running
    requests finish for up to shutdown_timeout seconds, cancel the rest, return 0. `config` / `engine_config`:
    the server's and the engine's settings; `options`, any of their fields by name (port=8001,
    block_size=32), over them. Every setting is checked before anything binds or loads."""
    config, engine_config = _configs(options, config, engine_config)
    host, port = config.host, config.port
    # bound before the model loads (minutes for a big one), so that a port in use is said at once; listening
    # only after it: a client connecting meanwhile is refused rather than left waiting in the backlog
    sock = _bind(host, port)
    try:
        if is_encoder_folder(model):  # an encoder: /v1/embeddings (embeddings.py)
            app = create_embeddings_app(load_embedder(model, config.name), config)
            name = app.state.embedder.name
        else:
            served = load_served(model, config.name, config.quantize)
            app = create_app(served, build_engine(served, engine_config), config)
            name = served.name
        try:
            sock.listen(2048)  # connections wait in the backlog from now on, even before uvicorn's loop runs
        except OSError as e:  # another socket took the port first (both bound with SO_REUSEADDR)
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        return _run(app, name, sock, host, config.shutdown_timeout)
    finally:
        sock.close()


def _configs(options: dict[str, Any], config: ServeConfig | None, engine_config: EngineConfig | None,
             serving: bool = True) -> tuple[ServeConfig, EngineConfig]:
    """The server's and the engine's settings: the configs given (else the defaults) with `options`, their
    fields by name, over them; an option of neither is a ConfigError naming the closest field (serving=False:
    the engine's alone)."""
    options = dict(options)
    engine = EngineConfig.merged(engine_config, options)
    names = [f.name for f in fields(ServeConfig)] if serving else []
    mine = {k: options.pop(k) for k in list(options) if k in names}
    if options:
        key = next(iter(options))
        raise ConfigError(f"unknown serve option {key!r}"
                          f"{suggest(key, names + [f.name for f in fields(EngineConfig)])}")
    server = config if config is not None else ServeConfig()
    return (dataclasses.replace(server, **mine) if mine else server), engine


def _make_server(app: Any, shutdown_timeout: float) -> GracefulServer:
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=shutdown_timeout)
    server = GracefulServer(config)
    api = getattr(app.state, "api", None)
    if api is None:  # an embeddings server: no engine thread to watch
        return server
    # from the signal on, a request not yet admitted (its connection accepted before uvicorn closed the
    # listener) gets a 503 "shutting down" instead of starting: only those already running get the shutdown
    # timeout
    server.on_exit = lambda: setattr(api, "shutting_down", True)
    # an engine that died (a bug, out of memory) cannot serve again: stop the process, as vLLM does, so that a
    # supervisor restarts it rather than keeping a server that answers 503 forever
    api.worker.on_error = lambda e: setattr(server, "should_exit", True)
    return server


def _run(app: Any, name: str, sock: socket.socket, host: str, shutdown_timeout: float) -> int:
    bound = sock.getsockname()[1]
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"qkv serve: listening on {host}: anyone who can reach this address can use the model")
    shown = f"[{host}]" if ":" in host else host
    print(f"qkv serve: model '{name}' at http://{shown}:{bound}/v1  (Ctrl-C to stop)", flush=True)
    server = _make_server(app, shutdown_timeout)
    worker = app.state.api.worker if hasattr(app.state, "api") else None
    server.run(sockets=[sock])
    if worker is not None and worker.error is not None:
        print(f"qkv serve: stopped: the engine failed ({type(worker.error).__name__}: {worker.error})",
              file=sys.stderr, flush=True)
        return 1
    print("qkv serve: stopped", file=sys.stderr, flush=True)
    return 0
