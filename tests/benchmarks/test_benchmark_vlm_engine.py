"""The smoke form of benchmarks/vlm_engine.py: it runs end to end (the repeats' first tokens equal the new
image's, which it asserts) and encodes each image once in the prefix-caching engine."""


import pytest


@pytest.mark.slow
def test_vlm_engine_one_trial(run_benchmark):
    r = run_benchmark("vlm_engine", "--trials", "1")
    assert "same image + prompt" in r.stdout
    assert "images encoded 1, embeddings from the LRU 1" in r.stdout
