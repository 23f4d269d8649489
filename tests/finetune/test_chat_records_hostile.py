"""Hostile chat records (messages and ShareGPT): each is one ConfigError naming file:line, decided before
memory proportional to what the record claims is taken (RecordLimits)."""

from __future__ import annotations

import json
import time

import pytest

from qkv.config import ConfigError
from qkv.finetune.chat_data import RecordLimits, read_chats

TURN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
SHAREGPT = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]


def lines(tmp_path, *records: str):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(records) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("record, message", [
    ({"messages": TURN * 500_000}, "'messages' holds 1,000,000 turns, over the limit of 4,096"),
    ({"conversations": SHAREGPT * 500_000}, "'conversations' holds 1,000,000 turns, over the limit of 4,096"),
    ({"messages": [{"role": "robot", "content": "hi"}, TURN[1]]}, "message 0 has unknown role 'robot'"),
    ({"messages": [{"role": ["user"], "content": "hi"}, TURN[1]]}, r"message 0 has unknown role \['user'\]"),
    ({"conversations": [{"from": {"a": 1}, "value": "hi"}, SHAREGPT[1]]},
     r"conversation turn 0 is from \{'a': 1\}"),
    ({"conversations": [{"from": ["gpt"], "value": "hi"}]}, r"conversation turn 0 is from \['gpt'\]"),
])
def test_hostile_records_are_one_line(tmp_path, record, message):
    t = time.perf_counter()
    with pytest.raises(ConfigError, match=f"data.jsonl:1: {message}"):
        read_chats(lines(tmp_path, json.dumps(record)))
    assert time.perf_counter() - t < 60


@pytest.mark.parametrize("line, message", [
    ('{"messages": [{"role": "user", "content": ' + "[" * 100_000 + "]" * 100_000 + "}]}",
     r"invalid JSON \(nested too deeply\)"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": ' + "[" * 100_000 + "]" * 100_000
     + "}]}]}", r"invalid JSON \(nested too deeply\)"),
    ('{"messages": [{"role": "user", "content": ' + "9" * 5000 + "}]}", r"invalid JSON \(Exceeds the limit"),
])
def test_json_the_parser_refuses_is_one_line(tmp_path, line, message):
    with pytest.raises(ConfigError, match=f"data.jsonl:1: {message}"):
        read_chats(lines(tmp_path, line))


def test_the_limits_are_settings(tmp_path):
    path = lines(tmp_path, json.dumps({"messages": TURN * 3}))
    assert len(read_chats(path)[0][1]) == 6
    with pytest.raises(ConfigError, match="holds 6 turns, over the limit of 5"):
        read_chats(path, RecordLimits(max_turns=5))
    with pytest.raises(ConfigError, match=r"data.jsonl:1: the record is \d+ characters long, over the "
                                          "limit of 100"):
        read_chats(path, RecordLimits(max_chars=100))
