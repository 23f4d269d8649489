"""benchmarks/profile_ops.py --quick: each comparison runs end to end and writes its JSON and table (which
kernels a CPU runs is not asserted: that differs between machines)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train_vs_nanogpt_bench import STAND_IN  # noqa: E402


def run(run_benchmark: Callable, tmp_path: Path, *args: str) -> dict:
    run_benchmark("profile_ops", *args, "--quick", "--threads", "1", "--min-ms", "0", "--out", str(tmp_path))
    return json.loads(next(tmp_path.glob("profile_*_quick.json")).read_text())


@pytest.mark.slow
def test_prefill_profile_quick(tmp_path, run_benchmark):
    res = run(run_benchmark, tmp_path, "prefill", "--family", "llama")
    assert res["aten_calls"]["qkv"] > 0 and res["aten_calls"]["transformers"] > 0
    assert res["total_ms"]["qkv"] > 0 and "| op |" in next(tmp_path.glob("*.md")).read_text()


def test_train_profile_quick(tmp_path, run_benchmark):
    model_py = tmp_path / "model.py"
    model_py.write_text(STAND_IN, encoding="utf-8")
    res = run(run_benchmark, tmp_path / "out", "train", "--nanogpt", str(model_py))
    assert set(res["total_ms"]) == {"qkv", "qkv exact GELU", "nanoGPT"}
    assert all(ms > 0 for ms in res["total_ms"].values()) and res["rows"]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--dtype", "bfloat16", "--batch", "4")])
def test_step_profile_quick(tmp_path, extra, run_benchmark):
    res = run(run_benchmark, tmp_path, "step", "--family", "llama", *extra)
    assert (res["aten_calls"]["qkv"] > 0 and res["aten_calls"]["transformers"] > 0
            and "decoding step" in res["what"])
    if extra:
        assert "batch 4, bfloat16" in res["what"]


def test_beam_profile_quick(tmp_path, run_benchmark):
    res = run(run_benchmark, tmp_path, "beam")
    assert res["total_ms"]["qkv"] > 0 and res["total_ms"]["transformers"] > 0 and "beam search" in res["what"]
