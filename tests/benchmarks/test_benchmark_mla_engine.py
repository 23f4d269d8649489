"""The smoke form of benchmarks/mla_engine.py: it runs end to end (the Engine's greedy tokens equal
generate()'s, which it asserts) and prints the paged pool's DeepSeek-V3 figures."""

import pytest


@pytest.mark.slow
def test_mla_engine_quick(run_benchmark):
    pytest.importorskip("transformers")
    r = run_benchmark("mla_engine", "--quick")
    assert "| MLA, latent 512 + rotary key 64 (PagedLatentCache) | 70,272 | 1.07 |" in r.stdout
    assert "| MHA, 128 heads x 128 (PagedKVCache) | 3,997,696 | 61.00 |" in r.stdout
    assert "greedy tokens equal" in r.stdout
    assert "| Engine, paged latent cache, requests batched |" in r.stdout
