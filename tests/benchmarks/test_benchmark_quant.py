"""The smoke form of benchmarks/quant.py (weight-only int8/int4: accuracy on a trained char GPT, decode speed
on a Llama folder): it runs end to end and every figure is there. The full run and its figures:
docs/llm.md."""

import json

import pytest


@pytest.mark.slow
def test_quant_benchmark_quick(tmp_path, run_benchmark):
    pytest.importorskip("transformers")
    run_benchmark("quant", "--quick", "--threads", "1", "--out", str(tmp_path))
    result = json.loads((tmp_path / "quant_quick.json").read_text())
    variants = ["fp32", "bf16", "int8 (fp32 model)", "int4 (fp32 model)", "int8 (bf16 model)",
                "int4 (bf16 model)"]
    acc, decode = result["accuracy"]["rows"], result["decode"]
    assert [r["variant"] for r in acc] == [r["variant"] for r in decode] == variants
    assert all(r["perplexity"] > 1 and 0 <= r["greedy_equal"] <= 1 for r in acc)
    assert acc[0]["greedy_equal"] == decode[0]["greedy_equal"] == 1.0  # fp32 against itself
    assert all(r["ms_per_token"] > 0 and r["weight_bytes"] > 0 for r in decode)
    # int8 < bf16 < fp32
    assert decode[4]["weight_bytes"] < decode[1]["weight_bytes"] < decode[0]["weight_bytes"]
    assert decode[4]["layers"] == "11 int8" and decode[5]["layers"] == "11 int4"  # 2 blocks x 5 + the head
    assert (tmp_path / "quant_quick.md").read_text().startswith("trained char GPT")
