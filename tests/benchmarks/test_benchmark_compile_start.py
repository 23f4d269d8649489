"""benchmarks/compile_start.py --quick runs its three fresh processes and writes its results; the compiled
runs leave Inductor's code in the cache folder they were given (its size is reported)."""

import json

import pytest


@pytest.mark.slow
def test_compile_start_quick(tmp_path, run_benchmark):
    pytest.importorskip("transformers")
    run_benchmark("compile_start", "--quick", "--new", "4", "--threads", "1", "--out", str(tmp_path),
                  timeout=1200)
    result = json.loads((tmp_path / "compile_start_quick.json").read_text())
    assert result["cache_mb"] > 0
    assert min(result["eager_s"], result["compiled_cold_s"], result["compiled_warm_s"]) > 0
