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
    objects around `base` (id, created, model)."""

    def __init__(self, base: dict, chat: bool) -> None:
        self.base, self.chat = base, chat
        self.object = "chat.completion.chunk" if chat else "text_completion"
        # a token's event is chunk(piece, None) with only the piece changing: made once, the piece put in
        # with json.dumps (the same bytes as chunk's, tests/serve: no dict and no whole-object dumps a token)
        self.head, self.tail = self.chunk(_MARK, None).split(json.dumps(_MARK))

    def chunk(self, piece: str | None, reason: str | None, first: bool = False, **extra: Any) -> str:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else (
                {"content": piece} if piece else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": reason, "logprobs": None}
        return event({**self.base, "object": self.object, "choices": [choice], **extra})

    def tool_calls(self, content: str | None, calls: list[dict]) -> str:
        """A chat delta with the answer's tool calls (each whole, with its index) and the content beside
        them."""
        delta: dict[str, Any] = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
        if content:
            delta["content"] = content
        choice = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}
        return event({**self.base, "object": self.object, "choices": [choice]})

    def piece(self, text: str) -> str:
        return self.head + json.dumps(text) + self.tail

    def end(self, text: str, reason: str, usage: dict, include_usage: bool) -> list[str]:
        """The last events: the rest of the text with the finish reason, usage, [DONE]."""
        if include_usage:  # OpenAI's form: usage only on a last chunk of its own
            return [self.chunk(text, reason, usage=None),
                    event({**self.base, "object": self.object, "choices": [], "usage": usage}), DONE]
        # an extension (as vLLM's continuous usage): the last chunk carries it
        return [self.chunk(text, reason, usage=usage), DONE]
