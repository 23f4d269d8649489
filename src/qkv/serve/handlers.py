"""The one request -> engine -> response path both endpoints share: read and check the body, admit the
request, then answer with one JSON object (the whole text) or a stream of server-sent events."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from qkv.generate.engine import TEXT_CONTEXT
from qkv.generate.text import StreamDecoder, cut_at_stop, decode_continuation
from qkv.serve.checks import DEFAULT_MAX_TOKENS
from qkv.serve.errors import APIError, cancelled
from qkv.serve.model import Served
from qkv.serve.sse import Chunks, Stream, error_event
from qkv.serve.worker import Ticket


class API(Protocol):
    """What handling a request needs from the server (app.API): its request checks, admission and the
    engine's deliveries; a protocol, so that this module stands below app.py."""

    served: Served

    async def body(self, request: Request, chat: bool) -> Any: ...
    def chat_ids(self, body: Any) -> tuple[list[int], list[Any] | None]: ...
    def prompt_ids(self, body: Any) -> list[int]: ...
    def options(self, body: Any, prompt_len: int, default_max: int | None) -> dict[str, Any]: ...
    def admit(self, prompt: list[int], opts: dict[str, Any]) -> Ticket: ...
    def release(self, t: Ticket, reason: str | None) -> None: ...
    def batches(self, t: Ticket, request: Request) -> AsyncIterator[list[tuple[str, Any]]]: ...


@dataclass
class Job:
    """One admitted request: its ticket, the ids its text is decoded after, and the response's common
    fields."""

    api: API
    request: Request
    ticket: Ticket
    chat: bool
    context: list[int]
    stop: list[str]
    base: dict

    def usage(self, n: int) -> dict:
        p = self.ticket.prompt_len
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


async def handle(api: API, request: Request, chat: bool) -> Response:
    """POST /v1/completions (chat False) and /v1/chat/completions (chat True)."""
    body = await api.body(request, chat)
    # off the event loop: tokenizing a long prompt (template, images decoded and preprocessed) must not stall
    # other clients' streams
    if chat:
        ids, images = await asyncio.to_thread(api.chat_ids, body)
    else:
        ids, images = await asyncio.to_thread(api.prompt_ids, body), None
    opts = api.options(body, len(ids), None if chat else DEFAULT_MAX_TOKENS)
    stream, include_usage = body.stream, body.include_usage
    t = api.admit(ids, opts if images is None else {**opts, "images": images})
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    base = {"id": rid, "created": int(time.time()), "model": api.served.name}
    # the prompt's last ids as context: the engine's stop check reads the same ones
    job = Job(api, request, t, chat, ids[-TEXT_CONTEXT:], opts.get("stop_strings", []), base)
    if stream:
        return Stream(stream_events(job, include_usage), lambda: api.release(t, None))
    return await whole(job)


async def whole(job: Job) -> JSONResponse:
    """The response to a request not streamed: every token, then the text decoded once."""
    api, t, ids = job.api, job.ticket, []
    reason = None
    try:
        async for items in api.batches(t, job.request):
            for kind, v in items:
                if kind == "token":
                    ids.append(v)
                else:
                    reason = v
    except asyncio.CancelledError:  # --shutdown-timeout ran out (uvicorn cancels what still runs)
        raise cancelled(shutdown=True) from None
    finally:
        api.release(t, reason)
    if reason is None or reason == "cancelled":
        raise cancelled(shutdown=False)
    content = cut_at_stop(decode_continuation(api.served.codec.decode, job.context, ids), job.stop)
    if job.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": reason,
                  "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": content, "finish_reason": reason, "logprobs": None}
        obj = "text_completion"
    return JSONResponse({**job.base, "object": obj, "choices": [choice], "usage": job.usage(len(ids))})


async def stream_events(job: Job, include_usage: bool) -> AsyncIterator[str]:
    """The events of a streamed request: a piece of text as each token completes one, then the end."""
    api, t = job.api, job.ticket
    chunks = Chunks(job.base, job.chat)
    text = StreamDecoder(api.served.codec.decode, job.stop, job.context)
    n, reason = 0, None
    try:
        if job.chat:
            yield chunks.chunk(None, None, first=True)
        try:
            async for items in api.batches(t, job.request):
                out = []
                for kind, v in items:
                    if kind == "token":
                        n += 1
                        piece = text.push(v)
                        if piece:
                            out.append(chunks.piece(piece))
                    else:
                        reason = v
                if out:  # the events of one delivery in one write
                    yield "".join(out)
        except APIError as e:  # the status line is long gone: the error as an event
            yield error_event(e)
            return
        except asyncio.CancelledError:
            # uvicorn cancels the responses still running when --shutdown-timeout runs out: end the stream as
            # any other ends, with a reason, rather than cut it (a client would wait for more), and without an
            # "Exception in ASGI application" traceback (sse.Stream.__call__)
            yield error_event(cancelled(shutdown=True))
            return
        if reason == "cancelled":  # by the engine thread's end (shutdown): say so; None: the client left
            yield error_event(cancelled(shutdown=False))
        if reason in (None, "cancelled"):
            return
        for e in chunks.end(text.flush(), reason, job.usage(n), include_usage):
            yield e
    finally:
        api.release(t, reason)
