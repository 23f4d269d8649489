"""Requests with images (a LLaVA model's image_url parts): generated one at a time on a thread of their own.

The paged Engine cannot carry them: its prefill feeds token ids to model.step, and an image enters as patch
embeddings that replace the prompt's placeholder tokens (LLaVA.images, the path of model.generate with
pixel_values and of `qkv chat --image`). So an image request runs qkv.generate.stream on that path, with a
KV cache of its own outside the engine's pool, its tokens delivered to its Ticket as the engine thread
delivers theirs: the handlers, streaming and the response are the same. It is admitted under the same
limits (the API's max_batch_size + max_waiting count, the context and pool checks); it never shares the
prefix cache, so two requests with the same placeholder ids but different images can never be mixed up.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from typing import Any

import torch
from torch import Tensor

from qkv.generate import stream
from qkv.generate.engine import Engine
from qkv.serve.worker import Ticket, deliver


class VisionWorker:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._keys = itertools.count()
        self._cancelled: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qkv-vision", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- called from the event loop -------------------------------------------------------------------
    def submit(self, prompt: list[int], options: dict[str, Any], pixel_values: Tensor) -> Ticket:
        t = Ticket(next(self._keys), len(prompt), asyncio.get_running_loop(), worker=self)
        self._commands.put((t, prompt, options, pixel_values))
        return t

    def cancel(self, ticket: Ticket) -> None:
        self._cancelled.add(ticket.key)  # read by the generating thread before each token

    # -- the vision thread ----------------------------------------------------------------------------
    def _send(self, t: Ticket, item: tuple) -> None:
        try:
            t.loop.call_soon_threadsafe(deliver, [(t, item)])
        except RuntimeError:  # that loop is closed: nobody is listening any more
            pass

    def _run(self) -> None:
        while True:
            cmd = self._commands.get()
            if cmd is None:
                break
            t = cmd[0]
            if self._stop.is_set() or t.key in self._cancelled:
                self._send(t, ("done", "cancelled"))
                continue
            try:
                reason = self._generate(*cmd)
            except Exception as e:  # noqa: BLE001  this request fails alone; the server goes on
                self._send(t, ("failed", f"generation failed: {type(e).__name__}: {e}"))
            else:
                self._send(t, ("done", reason))
            self._cancelled.discard(t.key)

    def _generate(self, t: Ticket, prompt: list[int], options: dict[str, Any], pixel_values: Tensor) -> str:
        """One request's tokens to its ticket, as the engine ends a request: "stop" at an eos id or a stop
        string (the engine's own stop-string watch), "length" at max_new_tokens."""
        engine, model = self.engine, self.engine.model
        cfg = engine.cfg.replace(**{k: v for k, v in options.items() if v is not None})
        # every setting given (none of the folder's extras applies unasked: build_engine's rule), stop strings
        # watched below with the engine's decoder
        settings = {k: v for k, v in cfg.to_dict().items() if k != "stop_strings"}
        watch = engine.output.stop_strings(prompt, list(cfg.stop_strings or []))
        eos, n = set(cfg.eos_ids), 0
        ids = torch.tensor([prompt], device=engine.device)
        with model.images(pixel_values):
            tokens = stream(model, ids, None, **settings)
            try:
                for new in tokens:
                    if self._stop.is_set() or t.key in self._cancelled:
                        return "cancelled"
                    tok, n = int(new[0]), n + 1
                    if t.first_token is None:
                        t.first_token = time.monotonic()
                    self._send(t, ("token", tok))
                    if tok in eos or (watch is not None and watch.push(tok)):
                        return "stop"
                    if n >= cfg.max_new_tokens:
                        return "length"
            finally:
                tokens.close()
        return "length"
