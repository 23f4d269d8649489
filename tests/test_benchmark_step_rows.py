"""The smoke form of benchmarks/step_rows.py (a decoding step's linear products by number of rows, per path): it
runs, every path computes F.linear's function, and every figure is there."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_step_rows_benchmark_quick(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_rows.py"), "--quick", "--threads", "1",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "step_rows_quick.json").read_text())
    paths = {p["path"] for p in result["products"]}
    assert {"F.linear", "transposed"} <= paths
    assert {(p["shape"], p["rows"]) for p in result["products"]} == {(s, m) for s in ("qkv", "o", "gate/up", "down", "head")
                                                                    for m in (1, 8)}
    assert all(p["ms"] > 0 and p["max_abs_err"] < 1e-4 for p in result["products"])
    assert {(s["rows"], s["path"]) for s in result["step"]} == {(m, p) for m in (1, 8) for p in paths}
    assert (tmp_path / "step_rows_quick.md").read_text().startswith("1 threads")
