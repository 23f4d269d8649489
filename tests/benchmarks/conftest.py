"""The benchmark smoke tests run each script as a user would: `python benchmarks/NAME.py ARGS`, one thread."""

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture
def run_benchmark() -> Callable[..., subprocess.CompletedProcess]:
    """run_benchmark("prefill", "--quick", "--out", DIR): the script's completed process (exit status 0)."""
    return _run
