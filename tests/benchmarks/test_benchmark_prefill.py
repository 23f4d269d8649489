"""The smoke form of benchmarks/prefill.py (long-prompt prefill vs transformers): it runs end to end, writes
its JSON and table, and qkv's last-position logits agree with transformers' on the same weights."""

import json

import pytest


@pytest.mark.slow
def test_prefill_quick(tmp_path, run_benchmark):
    pytest.importorskip("transformers")
    run_benchmark("prefill", "--quick", "--threads", "1", "--ablate", "--out", str(tmp_path))
    result = json.loads((tmp_path / "prefill_quick.json").read_text())
    assert ({(r["family"], r["tokens"]) for r in result["rows"]}
            == {(f, n) for f in ("gpt2", "llama") for n in (16, 32)})
    for row in result["rows"]:
        # qkv (and its --ablate full-top-block control) compute the same function as transformers
        assert row["max_abs_logit_diff"] < 1e-4, row
        assert row["qkv_tok_s"] > 0 and row["hf_tok_s"] > 0 and row["full_top_s"] > 0
    assert "| model |" in (tmp_path / "prefill_quick.md").read_text()
