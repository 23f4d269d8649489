"""The smoke form of benchmarks/speculative.py: it runs end to end on a tiny random Llama, every method's
greedy tokens equal plain greedy's (the Engine's with prompt lookup or a draft model its own without), and
every figure is there. The full run and its figures: docs/performance.md."""

import json

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["same", "cut:1"])
def test_speculative_benchmark_quick(tmp_path, run_benchmark, draft):
    pytest.importorskip("transformers")
    run_benchmark("speculative", "--quick", "--threads", "1", "--draft", draft, "--out", str(tmp_path))
    result = json.loads((tmp_path / "speculative.json").read_text())
    assert set(result["verify_ms"]) == {"1", "2", "4", "8", "11"}
    assert {r["task"] for r in result["decode"]} == {"rewrite", "free"}
    assert all(r["equal_to_plain"] and r["tok_s"] > 0 for r in result["decode"])
    assert all(r["acceptance"] is not None for r in result["decode"] if r["method"] != "plain")
    # the serving Engine at batch 1 and 4, speculation off, by prompt lookup and by a draft model: the same
    # tokens
    assert {(r["batch"], r["speculation"]) for r in result["engine"]} == {
        (b, s) for b in (1, 4) for s in ("off", "on", "draft model")}
    assert all(r["equal_to_off"] and r["tok_s"] > 0 for r in result["engine"])
    assert all(r["acceptance"] is not None for r in result["engine"] if r["speculation"] != "off")
    if draft == "cut:1":  # the damped model and its one-layer cut agree on most drafts
        assert all(r["acceptance"] > 0.5 for r in result["engine"] if r["speculation"] == "draft model")
