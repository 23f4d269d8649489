"""The smoke form of benchmarks/mla_engine.py: it runs end to end (the Engine's greedy tokens equal
generate()'s, which it asserts) and prints the paged pool's DeepSeek-V3 figures."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_mla_engine_quick():
    pytest.importorskip("transformers")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mla_engine.py"), "--quick"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "| MLA, latent 512 + rotary key 64 (PagedLatentCache) | 70,272 | 1.07 |" in r.stdout
    assert "| MHA, 128 heads x 128 (PagedKVCache) | 3,997,696 | 61.00 |" in r.stdout
    assert "greedy tokens equal" in r.stdout
    assert "| Engine, paged latent cache, requests batched |" in r.stdout
