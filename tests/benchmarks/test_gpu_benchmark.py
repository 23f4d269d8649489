"""benchmarks/gpu.py --device cpu --smoke: every section runs end to end on the CPU at a tiny size and writes
its JSON and markdown (the figures themselves come from a CUDA run, docs/performance.md)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


def test_gpu_benchmark_smoke_runs_every_section(tmp_path, run_benchmark):
    run_benchmark("gpu", "--device", "cpu", "--smoke", "--out", str(tmp_path), timeout=400)
    rows = json.loads((tmp_path / "gpu_smoke.json").read_text())["rows"]
    assert not [row for row in rows if "section_error" in row]
    assert {row["section"] for row in rows} == {"env", "peak", "train", "decode", "flash", "sync"}
    train = {row["impl"]: row for row in rows if row["section"] == "train" and "tok_s" in row}
    assert {"qkv bare loop", "HF GPT2LMHeadModel bare loop", "qkv bare loop + torch.compile",
            "qkv.train.Trainer"} <= set(train)
    # the same function; in bf16 on a CPU without native bf16 the eager loop takes qkv's fp32 route of bf16
    # autocast and the compiled one Inductor's kernels: equal up to bf16 rounding
    assert abs(train["qkv bare loop"]["loss"] - train["qkv bare loop + torch.compile"]["loss"]) <= 1e-3
    graphed = [row for row in rows if row["section"] == "decode" and row.get("impl") == "qkv graph-captured"]
    assert len(graphed) == 2 and all(row["tokens_equal_eager"] for row in graphed)
    assert len([row for row in rows if row["section"] == "flash" and "sdpa_calls" in row]) == 2
    # the long training step: the same weights and tokens through the fused and the naive attention give the
    # same loss up to bf16 rounding (which SDPA kernel a machine picks is reported, not asserted)
    long = {row["impl"]: row["loss"] for row in rows if row["section"] == "flash" and "loss" in row}
    assert (abs(long["qkv fused (SDPA)"] - long["qkv naive (scores materialised)"])
            <= 2e-2 * long["qkv fused (SDPA)"])
    assert [row["result"] for row in rows if row["section"] == "sync" and "result" in row] == ["ok"] * 3
    assert "| qkv graph-captured |" in (tmp_path / "gpu_smoke.md").read_text()
