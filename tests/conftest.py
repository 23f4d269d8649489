"""Shared fixtures: every test starts from the same random state, so failures reproduce.

Tests use tiny tensors, for which intra-op threads cost far more than they bring (on the shared 2-core
CI machine a 2-layer forward took 0.3 s with 2 threads and 3 ms with 1); parallelism comes from
`pytest -n 2` instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def torchrun():
    """Run `torchrun --standalone --nproc_per_node=2 ARGS` (gloo, CPU, one thread a rank) and return the
    CompletedProcess, failing the test unless it exits 0.

    gloo's TCP transport now and then aborts a rank (SIGABRT, "Connection reset by peer" on the other; seen once
    in CI on a loaded 2-core machine, never in 99 runs here, 40 of them with the cores hogged; pytorch/gloo#168).
    A run in which a rank died of a signal is run once more, with a warning in the test summary; a rank that
    fails in Python (exit code 1: a wrong value, an exception), or a second crash, fails the test. The failure
    message keeps the start of every rank's error as well as the end of the output, so the first error is never
    cut off.
    """
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("torchrun not found next to the python executable")

    def run(args: list[str], timeout: int = 600, cwd=None) -> subprocess.CompletedProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        cmd = [exe, "--standalone", "--nproc_per_node=2", *map(str, args)]
        for attempt in (1, 2):
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
            # torchrun's summary names the first rank to fail; a negative exit code is a signal (a crash)
            crashed = "Root Cause" in r.stderr and re.search(r"exitcode\s*:\s*-\d", r.stderr.split("Root Cause")[-1])
            if r.returncode == 0 or not crashed or attempt == 2:
                break
            warnings.warn(f"torchrun: a rank died of a signal; running once more:\n{_first_errors(r.stderr)}",
                          stacklevel=2)
        assert r.returncode == 0, (f"torchrun exit {r.returncode}\n-- first errors --\n{_first_errors(r.stderr)}"
                                   f"\n-- stdout tail --\n{r.stdout[-2000:]}\n-- stderr tail --\n{r.stderr[-3000:]}")
        return r

    return run


def _first_errors(stderr: str, context: int = 6) -> str:
    """Each distinct error line of a torchrun log (rank tracebacks' last lines, C++ aborts) with a few lines
    before it: the cause, which the tail of a long log leaves out."""
    lines = stderr.splitlines()
    keys = ("Error", "error:", "terminate called", "what():", "Signal ", "Aborted", "exitcode")
    picked, seen = [], set()
    for i, line in enumerate(lines):
        if any(k in line for k in keys) and line.strip() not in seen:
            seen.add(line.strip())
            picked.extend(lines[max(0, i - context):i + 1] + ["..."])
    return "\n".join(picked[-200:])[:8000]
