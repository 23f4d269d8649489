"""Data files (JSON Lines, CSV, TSV) are read one line per "\\n" (qkv.tasks.base.text_lines): str.splitlines
also split at a form feed, U+2028 or NEL inside a line, which cut a JSON Lines record (raw U+2028 is valid
inside a JSON string) or a TSV row in two and shifted every later line number."""

from __future__ import annotations

import json

from qkv.finetune.data import read_records
from qkv.finetune.seq2seq import read_pairs as finetune_pairs
from qkv.tasks.base import text_lines
from qkv.tasks.tsv import read_pairs as task_pairs

ODD = "a\u2028b\x0cc\x85d"  # characters str.splitlines breaks at


def test_text_lines_splits_at_newlines_only():
    assert text_lines(f"{ODD}\r\nx\n\ny") == [ODD, "x", "", "y"]
    assert text_lines("x\n") == ["x"] and text_lines("") == []


def test_jsonl_csv_tsv_and_conll_records_keep_their_lines(tmp_path):
    jl = tmp_path / "d.jsonl"
    jl.write_text(json.dumps({"text": ODD, "label": 1}, ensure_ascii=False) + "\n" +
                  json.dumps({"text": "two", "label": 0}) + "\n", encoding="utf-8")
    assert read_records(jl) == [(1, {"text": ODD, "label": 1}), (2, {"text": "two", "label": 0})]
    csv_file = tmp_path / "d.csv"
    csv_file.write_text(f'text,label\n"{ODD}",1\n"two\nlines",0\n', encoding="utf-8")
    assert ([r for _, r in read_records(csv_file)]
            == [{"text": ODD, "label": "1"}, {"text": "two\nlines", "label": "0"}])
    tsv = tmp_path / "p.tsv"
    tsv.write_text(f"{ODD}\tzh\nx\ty\n", encoding="utf-8")
    assert [p[:2] for p in finetune_pairs(tsv)] == [(ODD, "zh"), ("x", "y")]
    assert task_pairs(tsv) == [(ODD, "zh"), ("x", "y")]
