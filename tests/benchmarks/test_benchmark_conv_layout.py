"""The smoke form of benchmarks/conv_layout.py: both layouts train the same weights to the same first loss
(the script refuses to time otherwise) and each gets a timed step."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_conv_layout_quick(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "conv_layout.py"), "--quick",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "conv_layout_quick.json").read_text())
    first = result["first_loss"]
    assert first["NCHW"] == pytest.approx(first["channels_last"], rel=1e-2)
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in result["step_s"].values())
    assert "| channels_last |" in (tmp_path / "conv_layout_quick.md").read_text()
