"""benchmarks/finetune_encoder.py --quick runs end to end and writes its JSON and markdown (a smoke test;
the figures themselves come from full runs, docs/pretrained.md)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


def test_quick_benchmark_writes_results(tmp_path, run_benchmark):
    run_benchmark("finetune_encoder", "--quick", "--out", str(tmp_path), timeout=300)
    result = json.loads((tmp_path / "finetune_encoder_quick.json").read_text())
    assert {row["dtype"] for row in result["rows"]} == {"fp32", "bf16"}
    # per dtype: qkv, HF, qkv with unpadding off, and each project's trainer optimizer (+ clipping) for qkv
    # and HF
    assert len(result["rows"]) == 10
    # transformers >= 5, torch >= 2.8
    assert result["config"]["recipe_optimizers"] == {"qkv": "fused", "HF": "fused"}
    assert {r["model"] for r in result["rows"] if r["model"].startswith("recipe:")} == {
        "recipe: qkv BERT, qkv Trainer's AdamW + clip", "recipe: HF BERT, HF Trainer's AdamW + clip"}
    assert abs(losses_of(result, "recipe: qkv BERT, qkv Trainer's AdamW + clip fp32")
               - losses_of(result, "recipe: HF BERT, HF Trainer's AdamW + clip fp32")) < 1e-4
    assert len(result["ratios"]["fp32"]["recipe"]["per_round"]) == 2
    assert all(row["ratio_vs_hf_cpu_time"] > 0 for row in result["rows"])
    losses = result["first_step_loss"]  # same weights, same batch: the same function in fp32
    assert abs(losses["qkv BERT fp32"] - losses["HF BertForSequenceClassification (sdpa) fp32"]) < 1e-4
    assert abs(losses["qkv BERT, unpadding off fp32"] - losses["qkv BERT fp32"]) < 1e-5
    assert all(row["tokens_per_s"] > 0 for row in result["rows"])
    md = (tmp_path / "finetune_encoder_quick.md").read_text()
    assert "qkv / HF throughput" in md and "each trainer's AdamW (qkv fused, HF fused)" in md


def losses_of(result: dict, key: str) -> float:
    return result["first_step_loss"][key]
