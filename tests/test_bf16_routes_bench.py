"""benchmarks/bf16_routes.py --quick: every bf16 route runs against the op it replaces and gives its result (the
differences are bf16 rounding, never more)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from qkv.nn import linear

ROOT = Path(__file__).resolve().parents[1]


def test_bf16_routes_quick(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bf16_routes.py"), "--quick", "--threads", "1",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "bf16_routes_quick.json").read_text())
    fp16 = {"linear fp16 step"} if linear.fp16_packable() and not linear.native_bf16() else set()  # fbgemm, no bf16
    assert {row["bench"] for row in res["rows"]} == {"linear", "attention", "rmsnorm"} | fp16
    assert all(row["before_ms"] > 0 and row["qkv_ms"] > 0 for row in res["rows"])
    # bf16 results of magnitude ~1 (attention, norm) and ~0.1-1 (products of 0.05-scaled weights): 1-2 bf16 ulps at most
    assert all(row["max_abs_diff"] <= 0.0625 for row in res["rows"])
    assert "| bench | case |" in (tmp_path / "bf16_routes_quick.md").read_text()
