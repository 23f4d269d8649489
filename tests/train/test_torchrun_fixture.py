"""The `torchrun` fixture (tests/conftest.py) reruns a launch only when a rank died of a signal, never when a
rank failed in Python."""

import pytest

CRASH_ONCE = """
import os, sys
from pathlib import Path
mark = Path(sys.argv[1]) / f"ran{os.environ['RANK']}"
first = not mark.exists()
mark.touch()
if first and os.environ["RANK"] == "0":
    os.abort()  # SIGABRT, as gloo's transport does when a peer resets the connection
(Path(sys.argv[1]) / f"ok{os.environ['RANK']}").touch()  # a file, not print: the ranks' stdout interleaves
"""

RAISE = """
import os
raise ValueError("a wrong value on rank " + os.environ["RANK"])
"""


def test_a_crashed_rank_is_run_once_more(torchrun, tmp_path):
    script = tmp_path / "crash_once.py"
    script.write_text(CRASH_ONCE)
    with pytest.warns(UserWarning, match="died of a signal"):
        r = torchrun([script, tmp_path], timeout=120)
    assert r.returncode == 0 and (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


def test_a_python_error_fails_at_once(torchrun, tmp_path):
    script = tmp_path / "raise.py"
    script.write_text(RAISE)
    with pytest.raises(AssertionError, match="a wrong value on rank") as e:
        torchrun([script], timeout=120)
    assert "first errors" in str(e.value)
