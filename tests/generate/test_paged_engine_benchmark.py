"""The --quick CPU smoke form of benchmarks/paged_engine.py: it runs end to end, writes its JSON and markdown,
and every engine variant gives the static batch's tokens."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_paged_engine_benchmark_quick(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "paged_engine.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "paged_engine.py"), "--quick", "--requests",
                        "6", "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["tokens_identical"] and len(res["rows"]) == 3
    assert all(row["tok_per_s"] > 0 and row["cache_MiB"] > 0 for row in res["rows"])
    assert out.with_suffix(".md").read_text().startswith("| config |")
