"""The one request -> engine -> response path both endpoints share: read and check the body, admit the
request, then answer with one JSON object (the whole text) or a stream of server-sent events."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from qkv.generate.engine import TEXT_CONTEXT
from qkv.generate.text import StreamDecoder, cut_at_stop, decode_continuation
from qkv.serve.checks import DEFAULT_MAX_TOKENS
from qkv.serve.errors import APIError, cancelled
from qkv.serve.logprobs import LogprobFormat
from qkv.serve.model import Served
from qkv.serve.sse import DONE, Chunks, Stream, error_event
from qkv.serve.structured import ToolUse
from qkv.serve.tools import openai_tool_calls
from qkv.serve.worker import Ticket


class API(Protocol):
    """What handling a request needs from the server (app.API): its request checks, admission and the
    engine's deliveries; a protocol, so that this module stands below app.py."""

    served: Served

    async def body(self, request: Request, chat: bool) -> Any: ...
    def tool_use(self, body: Any) -> ToolUse | None: ...
    def grammar(self, body: Any) -> str | None: ...
    def chat_ids(self, body: Any, tools: ToolUse | None = None) -> tuple[list[int], list[Any] | None]: ...
    def prompt_ids(self, body: Any) -> list[int]: ...
    def options(self, body: Any, prompt_len: int, default_max: int | None) -> dict[str, Any]: ...
    def admit(self, prompt: list[int], opts: dict[str, Any]) -> Ticket: ...
    def release(self, t: Ticket, reason: str | None) -> None: ...
    def batches(self, t: Ticket, request: Request) -> AsyncIterator[list[tuple[str, Any]]]: ...


@dataclass
class Job:
    """One admitted request: its ticket, the ids its text is decoded after, and the response's common
    fields; its n choices, the log-probabilities it asked for (top: how many alternatives a token lists, None:
    none), with echo the prompt it sends back first, with tools how the calls in each answer are read."""

    api: API
    request: Request
    ticket: Ticket
    chat: bool
    context: list[int]
    stop: list[str]
    base: dict
    n: int = 1
    top: int | None = None
    echo: tuple[str, list[int]] | None = None  # (the prompt's text, its ids)
    tools: ToolUse | None = None  # the calls in each answer are parsed into tool_calls

    def answer(self, text: str, reason: str) -> tuple[str | None, list[dict], str]:
        """(content, OpenAI tool_calls, finish reason) of a chat answer's text: its calls read out where the
        request gave tools ("tool_calls" the reason of an answer that ended by itself with calls)."""
        if self.tools is None:
            return text, [], reason
        content, calls = self.tools.format.parse(text)
        if not calls:
            return content, [], reason
        return content, openai_tool_calls(calls), "tool_calls" if reason == "stop" else reason

    def usage(self, n: int) -> dict:
        p = self.ticket.prompt_len
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


@dataclass
class Choice:
    """One choice's tokens as they arrive, their log-probability entries, its finish reason."""

    ids: list[int] = field(default_factory=list)
    entries: list = field(default_factory=list)
    reason: str | None = None


async def handle(api: API, request: Request, chat: bool) -> Response:
    """POST /v1/completions (chat False) and /v1/chat/completions (chat True)."""
    body = await api.body(request, chat)
    # off the event loop: tokenizing a long prompt (template, images decoded and preprocessed) must not stall
    # other clients' streams
    tools = api.tool_use(body) if chat else None
    if chat:
        ids, images = await asyncio.to_thread(api.chat_ids, body, tools)
    else:
        ids, images = await asyncio.to_thread(api.prompt_ids, body), None
    opts = api.options(body, len(ids), None if chat else DEFAULT_MAX_TOKENS)
    # response_format, forced tool calls: one grammar, a matcher of its own per choice (the engine's)
    grammar = await asyncio.to_thread(api.grammar, body)
    if grammar is not None:
        opts["grammar"] = grammar
    stream, include_usage = body.stream, body.include_usage
    t = api.admit(ids, opts if images is None else {**opts, "images": images})
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    base = {"id": rid, "created": int(time.time()), "model": api.served.name}
    echo = None
    if not chat and body.echo:
        echo = (body.prompt if isinstance(body.prompt, str) else api.served.codec.decode(ids), ids)
    # the prompt's last ids as context: the engine's stop check reads the same ones
    job = Job(api, request, t, chat, ids[-TEXT_CONTEXT:], opts.get("stop_strings", []), base, opts["n"],
              opts["logprobs"], echo, tools)
    if stream:
        return Stream(stream_events(job, include_usage), lambda: api.release(t, None))
    return await whole(job)


def _read(items: list, choices: list[Choice], prompt: list) -> str | None:
    """One delivery's items into the choices (and the prompt's log-probabilities); the request's end
    reason when it is done."""
    reason = None
    for kind, v in items:
        if kind == "token":
            i, tok, entry = v
            choices[i].ids.append(tok)
            if entry is not None:
                choices[i].entries.append(entry)
        elif kind == "end":
            choices[v[0]].reason = v[1]
        elif kind == "prompt_logprobs":
            prompt[:] = v
        else:
            reason = v
    return reason


async def whole(job: Job) -> JSONResponse:
    """The response to a request not streamed: every token of every choice, then each text decoded once."""
    api, t = job.api, job.ticket
    choices, prompt = [Choice() for _ in range(job.n)], []
    reason = None
    try:
        async for items in api.batches(t, job.request):
            reason = _read(items, choices, prompt) or reason
    except asyncio.CancelledError:  # --shutdown-timeout ran out (uvicorn cancels what still runs)
        raise cancelled(shutdown=True) from None
    finally:
        api.release(t, reason)
    if reason is None or reason == "cancelled":
        raise cancelled(shutdown=False)
    if job.n == 1:
        choices[0].reason = reason
    out = [_choice_object(job, i, c, prompt) for i, c in enumerate(choices)]
    obj = "chat.completion" if job.chat else "text_completion"
    return JSONResponse({**job.base, "object": obj, "choices": out,
                         "usage": job.usage(sum(len(c.ids) for c in choices))})


def _choice_object(job: Job, index: int, c: Choice, prompt: list) -> dict:
    decode = job.api.served.codec.decode
    content = cut_at_stop(decode_continuation(decode, job.context, c.ids), job.stop)
    fmt = LogprobFormat(job.api.served.codec.token_text) if job.top is not None else None
    if job.chat:
        content, calls, reason = job.answer(content, c.reason)
        message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        return {"index": index, "message": message, "finish_reason": reason,
                "logprobs": fmt.chat(c.ids, c.entries) if fmt else None}
    ids, entries = c.ids, c.entries
    if job.echo is not None:
        content = job.echo[0] + content
        ids, entries = job.echo[1] + ids, (prompt or [None] * len(job.echo[1])) + entries
    return {"index": index, "text": content, "finish_reason": c.reason,
            "logprobs": fmt.completion(ids, entries) if fmt else None}


class ChoiceStream:
    """One choice's side of a stream: its text piece by piece (StreamDecoder), the log-probability entries of
    the tokens whose text is not sent yet, and where its next token's text starts (completions'
    text_offset). With tools, the text is held and read out at the end (a call's text is never content)."""

    def __init__(self, job: Job, index: int, fmt: LogprobFormat | None) -> None:
        self.job, self.index, self.fmt = job, index, fmt
        self.text = StreamDecoder(job.api.served.codec.decode, job.stop, job.context)
        self.pending: list[tuple[int, object]] = []
        self.offset = len(job.echo[0]) if job.echo is not None else 0
        self.count = 0
        self.held: list[str] | None = [] if job.tools is not None else None

    def logprobs(self, ids: list[int], entries: list) -> dict:
        if self.job.chat:
            return self.fmt.chat(ids, entries)
        out = self.fmt.completion(ids, entries, self.offset)
        self.offset += sum(len(x) for x in out["tokens"])
        return out

    def push(self, chunks: Chunks, tok: int, entry: object) -> str:
        """The event of a token: its piece of text (none while a character or a stop string is incomplete),
        with the log-probabilities of the tokens it completes."""
        self.count += 1
        piece = self.text.push(tok)
        if self.fmt is not None:
            self.pending.append((tok, entry))
        if self.held is not None:
            self.held.append(piece)
            return ""
        if not piece:
            return ""
        if self.fmt is None:
            return chunks.piece(piece, self.index)
        return chunks.chunk(piece, None, index=self.index, logprobs=self._take())

    def _take(self) -> dict | None:
        if self.fmt is None:
            return None
        ids, entries = [i for i, _ in self.pending], [e for _, e in self.pending]
        self.pending = []
        return self.logprobs(ids, entries)

    def end(self, chunks: Chunks, reason: str, **extra: object) -> str:
        """The choice's last events: with tools, its calls (their own delta, the content beside them), then
        the rest of its text with the finish reason."""
        rest, calls_event = self.text.flush(), ""
        if self.held is not None:
            content, calls, reason = self.job.answer("".join(self.held) + rest, reason)
            rest = "" if calls else content or ""
            if calls:
                calls_event = chunks.tool_calls(content, calls, index=self.index)
        return calls_event + chunks.chunk(rest, reason, index=self.index, logprobs=self._take(), **extra)


class StreamEvents:
    """What a stream sends around the tokens: its opening (chat's role, echo's prompt), each delivery's
    events, each choice's end, usage."""

    def __init__(self, job: Job, include_usage: bool) -> None:
        self.job, self.include_usage = job, include_usage
        self.chunks = Chunks(job.base, job.chat)
        fmt = LogprobFormat(job.api.served.codec.token_text) if job.top is not None else None
        self.streams = [ChoiceStream(job, i, fmt) for i in range(job.n)]
        self.ended = 0

    def opening(self) -> str:
        job, c = self.job, self.chunks
        if job.chat:
            return "".join(c.chunk(None, None, first=True, index=i) for i in range(job.n))
        if job.echo is not None and job.top is None:  # the prompt's text first (with logprobs: once scored)
            return "".join(c.chunk(job.echo[0], None, index=i) for i in range(job.n))
        return ""

    def usage(self) -> dict:
        return self.job.usage(sum(s.count for s in self.streams))

    def delivery(self, items: list) -> tuple[str, str | None]:
        """The events of one delivery (one write), and the request's end reason if it ended."""
        job, out, reason = self.job, [], None
        for kind, v in items:
            if kind == "done":
                reason = v
            if kind == "token":
                i, tok, entry = v
                out.append(self.streams[i].push(self.chunks, tok, entry))
            elif kind == "prompt_logprobs" and job.echo is not None:
                lp = self.streams[0].logprobs(job.echo[1], v)
                for s in self.streams:
                    s.offset = self.streams[0].offset
                out.extend(self.chunks.chunk(job.echo[0], None, index=i, logprobs=lp) for i in range(job.n))
            elif kind == "end" or (kind == "done" and job.n == 1):
                i, why = v if kind == "end" else (0, v)
                if why == "cancelled":  # the stream ends with an error event instead (stream_events)
                    continue
                self.ended += 1
                # OpenAI's include_usage: usage null on the choices' chunks, its own chunk at the end; else
                # (vLLM's continuous usage extension) the last choice's last chunk carries it
                extra = ({"usage": None} if self.include_usage else
                         {"usage": self.usage()} if self.ended == job.n else {})
                out.append(self.streams[i].end(self.chunks, why, **extra))
        return "".join(out), reason


async def stream_events(job: Job, include_usage: bool) -> AsyncIterator[str]:
    """The events of a streamed request: a piece of text as each token completes one (each choice's with its
    index), each choice's end, then usage and [DONE]."""
    api, t = job.api, job.ticket
    events = StreamEvents(job, include_usage)
    reason = None
    try:
        first = events.opening()
        if first:
            yield first
        try:
            async for items in api.batches(t, job.request):
                out, reason = events.delivery(items)
                if out:  # the events of one delivery in one write
                    yield out
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
        if include_usage:
            yield events.chunks.usage(events.usage())
        yield DONE
    finally:
        api.release(t, reason)
