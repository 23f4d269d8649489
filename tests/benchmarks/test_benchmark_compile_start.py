"""benchmarks/compile_start.py --quick runs its three fresh processes and writes its results; the compiled
runs leave Inductor's code in the cache folder they were given (its size is reported)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_compile_start_quick(tmp_path):
    pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_start.py"), "--quick", "--new",
                        "4",
                        "--threads", "1", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "compile_start_quick.json").read_text())
    assert result["cache_mb"] > 0
    assert min(result["eager_s"], result["compiled_cold_s"], result["compiled_warm_s"]) > 0
