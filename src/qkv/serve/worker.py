"""The engine loop: one thread owns the Engine; the event loop talks to it through a queue.

The HTTP handlers (asyncio) never touch the engine. They put commands ("add", "cancel") on a thread-safe
queue; the engine thread drains it before every step (so a cancel from a disconnected client takes effect
at the next step), runs engine.step(), and hands the new tokens and ends of ALL requests of that step back
to the event loop in one loop.call_soon_threadsafe (one wake-up of the loop a step, not one a token: with 64
streams that was 64 self-pipe writes and 64 callbacks a step); on the loop, `deliver` appends each item to
its ticket and wakes the handler waiting on it. With nothing to do the thread blocks on the queue.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qkv.generate.engine import Engine


@dataclass
class Ticket:
    """One accepted request, as the handler sees it."""

    key: int
    prompt_len: int
    loop: asyncio.AbstractEventLoop
    # ("token", (choice, id, logprob entry or None)) ... then ("done", reason), or ("failed", why) (this
    # request), or ("error", why) (the engine died): delivered, not yet read. With n > 1 choices each ends
    # with ("end", (choice, reason)) before the request's "done"; a request that asked for its prompt's
    # log-probabilities gets ("prompt_logprobs", entries) before its first token
    items: list = field(default_factory=list)
    n: int = 1  # choices (parallel samples of the prompt)
    logprobs: bool = False  # its tokens' log-probability entries are wanted
    waiter: asyncio.Future | None = None  # the handler waits on it for items (event-loop thread only)
    created: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    released: bool = False  # the handler is done with it (API.release)
    worker: Any = None  # the EngineWorker that runs it

    def wake(self) -> None:
        """Wake the handler waiting for items (event-loop thread)."""
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            w.set_result(None)


def deliver(batch: list[tuple[Ticket, tuple]]) -> None:
    """On the event loop: one engine step's items, in order, to their tickets (see the module doc)."""
    for t, item in batch:
        t.items.append(item)
        t.wake()


class EngineWorker:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # engine request id -> (ticket, choice index); ticket key -> its engine request ids (engine thread)
        self._tickets: dict[int, tuple[Ticket, int]] = {}
        self._by_key: dict[int, list[int]] = {}
        self._open: dict[int, int] = {}  # ticket key -> its choices not ended yet
        self._next_key = 0
        # items of this step, sent together by _flush (engine thread)
        self._outbox: list[tuple[Ticket, tuple]] = []
        self._lock = threading.Lock()
        self.stats: dict[str, Any] = engine.stats()  # a snapshot, refreshed after every step
        self.error: BaseException | None = None
        # called on the engine thread when it dies
        self.on_error: Callable[[BaseException], None] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qkv-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is left and end the thread."""
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -- called from the event loop -------------------------------------------------------------------
    def submit(self, prompt: list[int], options: dict[str, Any]) -> Ticket:
        with self._lock:
            key = self._next_key
            self._next_key += 1
        t = Ticket(key, len(prompt), asyncio.get_running_loop(), worker=self, n=options.get("n", 1),
                   logprobs=options.get("logprobs") is not None)
        self._commands.put(("add", t, prompt, options))
        return t

    def cancel(self, ticket: Ticket) -> None:
        self._commands.put(("cancel", ticket.key))

    # -- the engine thread ----------------------------------------------------------------------------
    def _send(self, t: Ticket, item: tuple) -> None:
        self._outbox.append((t, item))

    def _flush(self) -> None:
        """Hand the items gathered since the last flush to their event loops: one callback per loop."""
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        loops: dict[asyncio.AbstractEventLoop, list] = {}
        for t, item in batch:
            loops.setdefault(t.loop, []).append((t, item))
        for loop, items in loops.items():
            try:
                loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass

    def _drain(self, block: bool) -> None:
        while True:
            try:
                cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if cmd[0] == "add":
                _, t, prompt, options = cmd
                try:
                    rid = self.engine.add_request(prompt, **options)
                except Exception as e:  # checked before submit; a late error still reaches the client
                    self._send(t, ("failed", str(e)))  # this request alone: the engine goes on
                    continue
                rids = list(range(rid, rid + t.n))  # the engine numbers a request's choices in a row
                self._tickets.update((r, (t, i)) for i, r in enumerate(rids))
                self._by_key[t.key], self._open[t.key] = rids, t.n
            elif cmd[0] == "cancel":
                for rid in self._by_key.get(cmd[1], []):
                    self.engine.cancel(rid)
                self._finish_all()

    def _prompt_logprobs(self, rid: int, t: Ticket) -> None:
        entries = self.engine.prompt_logprobs(rid)
        if entries is not None:
            self._send(t, ("prompt_logprobs", entries))

    def _finish_all(self) -> None:
        for rid in self.engine.take_finished():
            t, i = self._tickets.pop(rid, (None, 0))
            error = self.engine.errors.get(rid)  # a request that failed on its own (the engine goes on)
            if t is not None:
                self._prompt_logprobs(rid, t)  # a request that asked for no new token: they are all it gets
            done = self.engine.pop_finished(rid)
            if t is None or t.key not in self._open:
                continue
            reason = done[1] if done else "cancelled"
            if error is not None:  # the whole request fails: its other choices stop
                self._send(t, ("failed", error))
                self._close(t)
                continue
            self._open[t.key] -= 1
            if t.n > 1:
                self._send(t, ("end", (i, reason)))
            if not self._open[t.key]:
                self._send(t, ("done", reason))
                self._close(t)

    def _close(self, t: Ticket) -> None:
        """The ticket is answered: forget it, cancelling its choices that still run."""
        del self._open[t.key]
        for rid in self._by_key.pop(t.key, []):
            if self._tickets.pop(rid, None) is not None:
                self.engine.cancel(rid)  # popped by the next _finish_all, which finds no ticket for it

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_work)
                self._flush()
                if self._stop.is_set():
                    break
                if self.engine.has_work:
                    events = self.engine.step()
                    now = time.monotonic()
                    for rid, tok in events:
                        t, i = self._tickets.get(rid, (None, 0))
                        if t is not None:
                            if t.first_token is None:
                                t.first_token = now
                            self._prompt_logprobs(rid, t)
                            entry = self.engine.token_logprobs(rid)[-1] if t.logprobs else None
                            self._send(t, ("token", (i, tok, entry)))
                    self._finish_all()
                    self._flush()
                self.stats = self.engine.stats()
        except BaseException as e:  # noqa: BLE001  every waiting client hears about it
            self.error = e
            for t in {id(t): t for t, _ in self._tickets.values()}.values():
                self._send(t, ("error", f"the engine stopped: {e}"))
            if self.on_error is not None:
                self.on_error(e)
            raise
        finally:
            for rid in list(self._tickets):
                self.engine.cancel(rid)
            for t in {id(t): t for t, _ in self._tickets.values()}.values():
                self._send(t, ("done", "cancelled"))
            self._tickets.clear()
            self._flush()
            self.stats = self.engine.stats()
