"""The smoke form of benchmarks/llm.py (qkv vs transformers on a Llama folder): it runs end to end, both
libraries produce the same greedy tokens, and every figure is there. The full run and its figures:
docs/llm.md."""

import json

import pytest


@pytest.mark.slow
def test_llm_benchmark_quick(tmp_path, run_benchmark):
    pytest.importorskip("transformers")
    run_benchmark("llm", "--quick", "--threads", "1", "--no-compile", "--out", str(tmp_path))
    result = json.loads((tmp_path / "llm_quick.json").read_text())
    assert {(d["library"], d["batch"]) for d in result["decode"]} >= {("qkv", 1), ("transformers", 1)}
    assert all(d["tok_per_s"] > 0 and d["floor_ms"] > 0 for d in result["decode"])
    assert result["token_agreement"]["bfloat16 batch 1"] == 1.0
    assert result["load"]["qkv bfloat16"]["dtype"] == "torch.bfloat16"
    assert {p["library"] for p in result["prefill"]} == {"qkv", "transformers"}
    assert result["meta"]["cpu_capability"] and isinstance(result["meta"]["native_bf16"], bool)
    assert (tmp_path / "llm_quick.md").read_text().startswith("read bandwidth")
