"""The Engine's output processor: sampled token ids -> each request's output, its end and why it ended.

A token is appended to its request's output and reported as a (request id, token) event; the request ends
with "stop" on one of its eos ids or once its text contains one of its stop strings, "length" at its
max_new_tokens, "error" when its token choice failed (the Sampler says why), "cancelled" when dropped.
Finished requests wait here, {id: tokens} and {id: reason}, until a caller takes them.

Stop strings are looked for in the text the output adds after the prompt, decoded piece by piece by
generate/text.py's StreamDecoder (the detokenising stream `qkv generate --stream`, `qkv chat` and the server
use) started on the prompt's last TEXT_CONTEXT tokens: decoded alone, a SentencePiece-style output loses its
first leading space, so a stop string " he" at the very start would never stop the request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qkv.generate.scheduler import Counters
from qkv.generate.text import StreamDecoder

# tokens decoded before a text and never part of it (vLLM's initial detokenization offset): a
# SentencePiece-style (Metaspace) decoder drops the leading space of a text's first token, which a
# continuation of a prompt keeps
TEXT_CONTEXT = 5


class StopStrings:
    """One request's stop-string watch: push() its output tokens one at a time; True once its text (after
    the prompt's context) contains one of the strings. The detokenising stream (StreamDecoder) decodes a
    short window per token, never the whole output, and searches only the text a token adds."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str], context: list[int]) -> None:
        # the prompt's tail as context: decoded so the output's first piece keeps its leading space
        self.stream = StreamDecoder(decode, stop=stop, context=context)

    def push(self, token_id: int) -> bool:
        self.stream.push(token_id)
        return self.stream.stopped


class OutputProcessor:
    def __init__(self, decode: Callable[[list[int]], str] | None, counters: Counters) -> None:
        self.decode = decode  # ids -> text, for stop strings (None: the engine has no tokenizer)
        self.counters = counters
        self.finished: dict[int, list[int]] = {}
        self.finish_reason: dict[int, str] = {}  # "stop" (eos / stop string), "length", "cancelled", "error"
        self.errors: dict[int, str] = {}  # why a request finished with "error" (until pop)
        self.just_finished: list[int] = []  # ids finished or cancelled since the last take()
        # requests that asked for log-probabilities (logprobs.py): their new tokens' entries (until pop),
        # their prompts' entries once computed (until taken: Engine.prompt_logprobs)
        self.logprobs: dict[int, list] = {}
        self.prompt_logprobs: dict[int, list] = {}

    def stop_strings(self, prompt: list[int], stop: list[str]) -> StopStrings | None:
        """A request's stop-string watch (None: it has none)."""
        if not stop:
            return None
        if self.decode is None:
            raise ValueError("stop_strings need the Engine's tokenizer= (to decode the tokens)")
        return StopStrings(self.decode, stop, prompt[-TEXT_CONTEXT:])

    def process(self, req: Any, tok: int | None, events: list[tuple[int, int]]) -> str | None:
        """Record req's sampled token (a scheduler.Request); its finish reason when it is done, else None.
        tok None: its token choice failed, it finishes with "error"."""
        if tok is None:
            return "error"
        req.output.append(tok)
        events.append((req.id, tok))
        self.counters.generated_tokens += 1
        if tok in req.eos:
            return "stop"
        if req.stop is not None and req.stop.push(tok):
            return "stop"
        if len(req.output) >= req.max_new_tokens:
            return "length"
        return None

    def finish(self, request_id: int, output: list[int], reason: str) -> None:
        self.finished[request_id], self.finish_reason[request_id] = output, reason
        if reason == "cancelled":
            self.counters.cancelled += 1
        else:
            self.counters.finished += 1
        self.just_finished.append(request_id)

    def pop(self, request_id: int) -> tuple[list[int], str] | None:
        """(tokens, finish reason) of a finished request, forgotten (a server's memory bound)."""
        if request_id not in self.finished:
            return None
        self.errors.pop(request_id, None)
        self.logprobs.pop(request_id, None)
        self.prompt_logprobs.pop(request_id, None)
        return self.finished.pop(request_id), self.finish_reason.pop(request_id)

    def take(self) -> list[int]:
        """The requests finished or cancelled since the last call (a server's signal to close streams)."""
        done, self.just_finished = self.just_finished, []
        return done
