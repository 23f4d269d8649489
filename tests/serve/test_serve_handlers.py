"""The one request -> engine -> response path: a streamed request sends the same text as the same request
answered whole; a value out of bounds is a 400 naming its field; a character whose bytes span tokens is sent
whole, never as U+FFFD."""

from __future__ import annotations

import httpx
import pytest
from _servehelpers import running_server, sse_events

from qkv.generate.text import StreamDecoder
from qkv.serve import load_served


def _utf8(ids: list[int]) -> str:
    """A byte tokenizer's decode: one token per byte, so every multi-byte character spans tokens."""
    return bytes(ids).decode("utf-8", errors="replace")


def test_a_multi_byte_character_split_across_tokens_streams_whole():
    text = "aé🙂東b"
    ids = list(text.encode())
    for stop, want in (([], text), (["東"], "aé🙂"), (["🙂東"], "aé")):
        stream = StreamDecoder(_utf8, stop)
        pieces = [stream.push(i) for i in ids] + [stream.flush()]
        assert "".join(pieces) == want, stop
        assert not any("\ufffd" in p for p in pieces)
        # each character goes out once its last byte is in, not before
        assert [p for p in pieces if p][:2] == ["a", "é"] or stop == ["🙂東"]
    stream = StreamDecoder(_utf8)
    assert [stream.push(i) for i in "🙂".encode()] == ["", "", "", "🙂"]


def _text(events: list[dict]) -> str:
    choices = [e["choices"][0] for e in events if e.get("choices")]
    return "".join(c["text"] if "text" in c else c["delta"].get("content") or "" for c in choices)


def test_streamed_and_whole_responses_give_the_same_text(gpt2_folder):
    served = load_served(gpt2_folder)
    with running_server(gpt2_folder, block_size=4) as (url, _):
        for path, body in (("/v1/completions", {"prompt": "The class"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
            for seed in range(3):
                body = {**body, "model": served.name, "max_tokens": 24, "temperature": 1.0, "seed": seed}
                whole = httpx.post(url + path, json=body, timeout=60).json()
                choice = whole["choices"][0]
                want = choice["text"] if "text" in choice else choice["message"]["content"]
                with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
                    events, done = sse_events(r.iter_lines())
                assert done and _text(events) == want, (path, seed)
                assert events[-1]["usage"] == whole["usage"]
                if len(want) > 4:  # a stop string from the text: both cut it at the same place
                    stopped = {**body, "stop": [want[2:4]]}
                    cut = httpx.post(url + path, json=stopped, timeout=60).json()["choices"][0]
                    with httpx.stream("POST", url + path, json={**stopped, "stream": True}, timeout=60) as r:
                        events, _ = sse_events(r.iter_lines())
                    assert _text(events) == (cut["text"] if "text" in cut else cut["message"]["content"])


@pytest.mark.parametrize("name, value", [
    ("temperature", -1), ("top_p", 0), ("top_k", -2), ("min_p", 2), ("repetition_penalty", 0),
    ("max_tokens", 0), ("seed", 2 ** 64), ("temperature", "hot")])
def test_a_value_out_of_bounds_is_a_400_naming_the_field(run_folder, name, value):
    served = load_served(run_folder)
    with running_server(run_folder, block_size=4) as (url, _):
        r = httpx.post(url + "/v1/completions", json={"model": served.name, "prompt": "ab", name: value},
                       timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == name and f"'{name}'" in err["message"], r.text
    assert err["type"] == "invalid_request_error"
