"""The smoke form of benchmarks/mla.py: it runs end to end and prints the cache table with DeepSeek-V3's
figures (576 numbers per token and layer for MLA, 32,768 for 128 heads of 128) and both decoding measures."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_mla_quick():
    pytest.importorskip("transformers")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mla.py"), "--quick"], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "| MLA, latent 512 + rotary key 64 (DeepSeek-V3) | 576 | 70,272 |" in r.stdout
    assert "| MHA, 128 heads x 128 | 32,768 | 3,997,696 |" in r.stdout
    assert "| greedy decoding, batch 1, tokens per CPU second |" in r.stdout and "| 64 |" in r.stdout
