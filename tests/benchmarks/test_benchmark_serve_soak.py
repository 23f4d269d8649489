"""The smoke forms of benchmarks/serve_soak.py (a 12-second soak: every kind of request answered as
expected, the samples written) and benchmarks/fuzz.py (a few examples per property)."""

import json

import pytest


@pytest.mark.slow
def test_serve_soak_runs_and_reports(run_benchmark, tmp_path):
    run_benchmark("serve_soak", "--minutes", "0.2", "--every", "6", "--out", str(tmp_path), timeout=600)
    result = json.loads((tmp_path / "serve_soak.json").read_text())
    assert result["failures"] == [] and result["requests"] > 0
    assert [s["at"] for s in result["samples"]][0] == "start" and result["samples"][-1]["at"] == "after drain"
    assert all(s["kv_blocks_used"] == 0 for s in result["samples"][-1:])  # nothing held after the drain
    assert "| after drain |" in (tmp_path / "serve_soak.md").read_text()


@pytest.mark.slow
def test_fuzz_runs_and_reports(run_benchmark, tmp_path):
    run_benchmark("fuzz", "--examples", "5", "--out", str(tmp_path), timeout=600)
    result = json.loads((tmp_path / "fuzz.json").read_text())
    assert result["exit_code"] == 0 and {c["outcome"] for c in result["cases"]} == {"passed"}
    assert "test_gguf_header_reader" in {c["property"] for c in result["cases"]}
