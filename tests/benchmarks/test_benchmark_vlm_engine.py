"""The smoke form of benchmarks/vlm_engine.py: it runs end to end (the repeats' first tokens equal the new
image's, which it asserts) and encodes each image once in the prefix-caching engine."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_vlm_engine_one_trial():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vlm_engine.py"), "--trials", "1"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "same image + prompt" in r.stdout
    assert "images encoded 1, embeddings from the LRU 1" in r.stdout
