"""The benchmark smoke tests run each script as a user would: `python benchmarks/NAME.py ARGS`, one thread."""

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 600,
         expect_status: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    r = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args], capture_output=True,
                       text=True, timeout=timeout, env=env)
    assert r.returncode == expect_status, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture
def run_benchmark() -> Callable[..., subprocess.CompletedProcess]:
    """run_benchmark("prefill", "--quick", "--out", DIR): the script's completed process (exit status 0).

    Keywords: env= variables added to the inherited environment, timeout= seconds, expect_status= the exit
    status the run must end with (a script's usage error is 2)."""
    return _run
