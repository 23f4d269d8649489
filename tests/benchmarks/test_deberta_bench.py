"""benchmarks/deberta.py --quick runs end to end and writes its JSON and markdown, with both models computing
the same function (a smoke test; the figures come from the full run, docs/pretrained.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


def test_quick_benchmark_writes_results(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "deberta.py"), "--quick", "--repeats", "2",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "deberta_quick.json").read_text())
    assert [row["case"] for row in result["rows"]] == ["forward", "train step"]
    assert result["logit_max_abs_diff"] < 1e-4
    assert result["first_losses"]["qkv"] == pytest.approx(result["first_losses"]["HF"], rel=1e-5)
    assert "| forward |" in (tmp_path / "deberta_quick.md").read_text()
