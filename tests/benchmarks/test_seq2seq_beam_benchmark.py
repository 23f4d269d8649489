"""The --quick smoke form of benchmarks/seq2seq_beam.py: it runs, writes its JSON and markdown, and qkv's beam
search gives HF's tokens on the benchmark's own inputs (speed is measured by the full form, never
asserted)."""

import json

import pytest

pytest.importorskip("transformers")


def test_seq2seq_beam_benchmark_quick(tmp_path, run_benchmark):
    run_benchmark("seq2seq_beam", "--quick", "--out", str(tmp_path))
    result = json.loads((tmp_path / "seq2seq_beam.json").read_text())
    assert result["tokens_equal"] is True  # qkv's beam search gives HF's tokens
    assert {row["config"] for row in result["rows"]} == {"qkv beam search", "HF MarianMTModel.generate"}
    assert all(row["sentences_per_s"] > 0 for row in result["rows"])
    assert "sentences/s" in (tmp_path / "seq2seq_beam.md").read_text()
