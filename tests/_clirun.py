"""`qkv ARGS` run by main() (what the `qkv` script calls) in the test's own process, reported as
subprocess.run reports a process: a new interpreter importing torch for every command would be most of these
tests' time. Tests that need a process of their own (a signal, a closed pipe, what importing qkv loads) start
one."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from pathlib import Path


def run_cli(*args: str, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Exit status, stdout and stderr of `qkv ARGS` run from `cwd` (default: where the test runs). A bug's
    exception is not caught: it fails the test with its traceback."""
    from qkv.cli.main import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(cwd or here)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's usage errors
                code = e.code
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())
