"""Server-sent events for a streamed completion: one `data: {json}` event per piece of text, the last chunk
with the finish reason (and usage), then `data: [DONE]`. An error after the status line is an event too."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from fastapi.responses import StreamingResponse

from qkv.serve.errors import APIError

_MARK = "\x00piece\x00"  # a stand-in text that json.dumps writes in one unmistakable way
DONE = "data: [DONE]\n\n"


class Stream(StreamingResponse):
    """A StreamingResponse that always runs on_close, even when the client is gone before the body's first
    chunk (the generator's own finally never runs then), and that ends quietly when uvicorn cancels it at the
    end of a graceful shutdown (the stream has sent its last event: handlers.stream_events)."""

    def __init__(self, content: Any, on_close: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:  # uvicorn stops the task either way; re-raised, it logs a traceback
            pass
        finally:
            self.on_close()


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def error_event(e: APIError) -> str:
    """The error as an event, then [DONE] (the status line is long gone), as vLLM sends it."""
    return event(json.loads(e.response().body)) + DONE


class Chunks:
    """The events of one streamed response: completions' `text_completion` or chat's `chat.completion.chunk`
    objects around `base` (id, created, model), one choice each (its `index`: n > 1 choices interleave)."""

    def __init__(self, base: dict, chat: bool) -> None:
        self.base, self.chat = base, chat
        self.object = "chat.completion.chunk" if chat else "text_completion"
        # a token's event is chunk(piece, None) with only the piece changing: made once per choice, the piece
        # put in with json.dumps (the same bytes as chunk's, tests/serve: no dict and no whole-object dumps a
        # token)
        self.templates: dict[int, tuple[str, str]] = {}

    def chunk(self, piece: str | None, reason: str | None, first: bool = False, index: int = 0,
              logprobs: dict | None = None, **extra: Any) -> str:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else (
                {"content": piece} if piece else {})
            choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": piece or "", "finish_reason": reason, "logprobs": logprobs}
        return event({**self.base, "object": self.object, "choices": [choice], **extra})

    def piece(self, text: str, index: int = 0) -> str:
        t = self.templates.get(index)
        if t is None:
            head, tail = self.chunk(_MARK, None, index=index).split(json.dumps(_MARK))
            t = self.templates[index] = (head, tail)
        return t[0] + json.dumps(text) + t[1]

    def tool_calls(self, content: str | None, calls: list[dict], index: int = 0) -> str:
        """A chat delta with the answer's tool calls (each whole, with its index) and the content beside
        them."""
        delta: dict[str, Any] = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
        if content:
            delta["content"] = content
        choice = {"index": index, "delta": delta, "finish_reason": None, "logprobs": None}
        return event({**self.base, "object": self.object, "choices": [choice]})

    def usage(self, usage: dict) -> str:
        """OpenAI's stream_options include_usage: usage on a last chunk of its own, with no choice."""
        return event({**self.base, "object": self.object, "choices": [], "usage": usage})
