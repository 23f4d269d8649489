"""The smoke form of benchmarks/repetition.py: it trains a 10-step char LM, continues a prompt under every
setting and writes distinct-n; no_repeat_ngram_size 12 leaves no 12-gram twice, so distinct-16 is 1."""

import json

import pytest


@pytest.mark.slow
def test_repetition_quick(tmp_path, run_benchmark):
    run_benchmark("repetition", "--quick", "--out", str(tmp_path))
    rows = {r["setting"]: r for r in json.loads((tmp_path / "repetition_quick.json").read_text())["rows"]}
    assert len(rows) == 5 and all(r["tokens"] == 120 for r in rows.values())
    assert rows["greedy, no_repeat_ngram_size 12"]["distinct_16"] == 1.0
    assert all(0 < r["distinct_4"] <= 1 and 0 <= r["loop_share"] <= 1 for r in rows.values())
