"""The --quick smoke form of benchmarks/seq2seq_beam.py: it runs, writes its JSON and markdown, and qkv's beam
search gives HF's tokens on the benchmark's own inputs (speed is measured by the full form, never
asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("transformers")


def test_seq2seq_beam_benchmark_quick(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "seq2seq_beam.py"), "--quick", "--out",
                        str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "seq2seq_beam.json").read_text())
    assert result["tokens_equal"] is True  # qkv's beam search gives HF's tokens
    assert {row["config"] for row in result["rows"]} == {"qkv beam search", "HF MarianMTModel.generate"}
    assert all(row["sentences_per_s"] > 0 for row in result["rows"])
    assert "sentences/s" in (tmp_path / "seq2seq_beam.md").read_text()
