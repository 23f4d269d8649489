"""benchmarks/bf16_autocast_route.py --quick runs end to end and writes its JSON and markdown (a smoke test; the
figures come from full runs, docs/perf/ft14e.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def test_quick_benchmark_writes_results(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bf16_autocast_route.py"), "--quick", "--off-row",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "bf16_autocast_route_quick.json").read_text())
    assert [row["row"] for row in result["rows"]] == [
        "qkv BERT fp32", "qkv BERT bf16 (route)", "qkv BERT bf16 (route off: autocast's kernels)"]
    assert all(row["tokens_per_s"] > 0 and len(result["wall"][row["row"]]) == 2 for row in result["rows"])
    losses = result["first_step_loss"]  # the same weights and batch: bf16 within bf16 tolerance of fp32 and each other
    route, off = losses["qkv BERT bf16 (route)"], losses["qkv BERT bf16 (route off: autocast's kernels)"]
    assert abs(route - off) < 2e-2 * abs(off) and abs(route - losses["qkv BERT fp32"]) < 5e-2 * abs(off)
    assert "step time vs fp32" in (tmp_path / "bf16_autocast_route_quick.md").read_text()
