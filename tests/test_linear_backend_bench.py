"""benchmarks/linear_backend.py --quick runs end to end and writes its JSON and markdown (a smoke test; the
figures come from full runs, docs/perf/onednn_linear.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qkv.nn import linear as L

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not L._probe(), reason="this torch build has no oneDNN fp32 linear")
def test_quick_benchmark_writes_results(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "linear_backend.py"), "--quick", "--threads", "1",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "linear_backend_quick.json").read_text())
    assert len(result["workloads"]) == 3
    for w in result["workloads"].values():
        assert len(w["ratio_per_round"]) == result["rounds"] == 2
        assert w["onednn_median_s"] > 0 and w["aten_median_s"] > 0
    assert "aten / oneDNN" in (tmp_path / "linear_backend_quick.md").read_text()
