"""The --quick CPU smoke form of benchmarks/structured.py: every engine walks the same valid answer (each
asserts its mask allowed every token), and qkv's Engine gives whole, parsing JSON answers under the grammar
and the same number of free tokens."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_structured_benchmark_quick(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "structured.py"), "--quick", "--engines",
                        "llguidance", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                       env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "structured_quick.json").read_text())
    assert {(row["grammar"], row["engine"]) for row in res["engines"]} == {("schema", "llguidance"),
                                                                          ("json_object", "llguidance")}
    assert all(row["tokens"] > 50 and row["per_token_us"] > 0 for row in res["engines"])
    assert res["engine"]["tokens"] > 0 and res["engine"]["free_tok_s"] > 0
    assert res["engine"]["in_mask_per_token_us"] > 0
