"""The smoke form of benchmarks/train_memory.py: it runs end to end and its estimates stay within 25% of the
measured peaks."""

import json

import pytest


@pytest.mark.slow
def test_train_memory_quick(tmp_path, run_benchmark):
    run_benchmark("train_memory", "--quick", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "train_memory_quick.json").read_text())["rows"]
    assert len(rows) == 4 and {r["checkpointing"] for r in rows} == {False, True}
    assert all(abs(r["ratio"] - 1) < 0.25 and r["measured_bytes"] > 0 for r in rows)
    assert "| gpt-tiny |" in (tmp_path / "train_memory_quick.md").read_text()
