"""The smoke form of benchmarks/attention_decode.py: it runs end to end, times every attention layout's
decoding step, and reads each cache's bytes per token from the cache the model allocates."""

import json

import pytest


@pytest.mark.slow
def test_attention_decode_quick(tmp_path, run_benchmark):
    run_benchmark("attention_decode", "--quick", "--out", str(tmp_path))
    result = json.loads((tmp_path / "attention_decode_quick.json").read_text())
    got = {k: v["cache_bytes_per_token"] for k, v in result["variants"].items()}
    # 2 layers of 8 heads of 8, fp32: 2 x kv heads x 8 numbers per layer; MLA latent 16 + rotary key 4
    assert got == {"MHA": 1024, "GQA": 256, "MQA": 128, "MLA": 160}
    for v in result["variants"].values():
        assert len(v["step_ms"]["64"]) == 2 and all(t > 0 for t in v["step_ms"]["64"])
    assert "| MLA |" in (tmp_path / "attention_decode_quick.md").read_text()
