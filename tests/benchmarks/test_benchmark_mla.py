"""The smoke form of benchmarks/mla.py: it runs end to end and prints the cache table with DeepSeek-V3's
figures (576 numbers per token and layer for MLA, 32,768 for 128 heads of 128) and both decoding measures."""

import pytest


@pytest.mark.slow
def test_mla_quick(run_benchmark):
    pytest.importorskip("transformers")
    r = run_benchmark("mla", "--quick")
    assert "| MLA, latent 512 + rotary key 64 (DeepSeek-V3) | 576 | 70,272 |" in r.stdout
    assert "| MHA, 128 heads x 128 | 32,768 | 3,997,696 |" in r.stdout
    assert "| greedy decoding, batch 1, tokens per CPU second |" in r.stdout and "| 64 |" in r.stdout
