"""The log-probability entries of the Engine (generate/logprobs.py) in OpenAI's response shapes.

    completions: {"tokens": [str], "token_logprobs": [float | null], "top_logprobs": [{str: float} | null],
                  "text_offset": [int]}                              (echo's first prompt token: null)
    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
                  "refusal": null}

A token's string is its id decoded alone, special tokens spelled out (as vLLM's): a character split over
byte-level tokens shows as U+FFFD in each. Completions' top_logprobs is keyed by those strings: of two tokens
with one string, the likelier is listed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qkv.generate.logprobs import TokenLogprob


class LogprobFormat:
    def __init__(self, token_text: Callable[[int], str]) -> None:
        self.token_text = token_text  # TextCodec.token_text
        self._text: dict[int, str] = {}

    def token(self, i: int) -> str:
        t = self._text.get(i)
        if t is None:
            t = self._text[i] = self.token_text(i)
        return t

    def completion(self, ids: list[int], entries: list[TokenLogprob | None], offset: int = 0) -> dict:
        """Completions' logprobs object of the tokens `ids`; offset: the first token's place in the text."""
        tokens = [self.token(i) for i in ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        top: list[dict[str, float] | None] = []
        for i, e in zip(ids, entries):
            if e is None:
                top.append(None)
                continue
            d: dict[str, float] = {}
            for j, lp in e.top:  # most likely first
                d.setdefault(self.token(j), lp)
            d.setdefault(self.token(i), e.logprob)  # the chosen token is listed too, as OpenAI's
            top.append(d)
        return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": top, "text_offset": offsets}

    def _item(self, i: int, logprob: float) -> dict[str, Any]:
        t = self.token(i)
        return {"token": t, "logprob": logprob, "bytes": list(t.encode("utf-8"))}

    def chat(self, ids: list[int], entries: list[TokenLogprob]) -> dict:
        """Chat's logprobs object of the tokens `ids`."""
        content = [{**self._item(i, e.logprob), "top_logprobs": [self._item(j, lp) for j, lp in e.top]}
                   for i, e in zip(ids, entries)]
        return {"content": content, "refusal": None}
