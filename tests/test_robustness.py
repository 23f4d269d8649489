"""The short CI form of benchmarks/robustness.py: SIGKILL a real `qkv train` run at random moments, resume
it each time, and check that it resumes from the newest complete checkpoint, leaks no folder, keeps best/
and metrics.jsonl, and ends bit-identical to an uninterrupted run. The full form (>= 20 kills, larger
checkpoints) and its figures: docs/robustness.md."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_kill_9_and_resume_loses_nothing(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "robustness.py"), "--kills", "3", "--quick",
                        "--seed", "1", "--out", str(tmp_path), "--work", str(tmp_path / "work")],
                       capture_output=True, text=True, timeout=900, env=env)
    result = json.loads((tmp_path / "robustness.json").read_text())
    assert r.returncode == 0 and result["failures"] == [], r.stdout[-3000:] + r.stderr[-3000:]
    assert result["kills"] == 3 and result["resumes_from_newest"] == 3
    assert result["exact_metrics"] and result["exact_weights"] and result["best_loads"]
