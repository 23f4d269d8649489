"""The smoke forms of benchmarks/decode_floor.py (every decoder family's batch-1 step against its weight-streaming
floor) and benchmarks/prefill.py (long-prompt prefill vs transformers): they run end to end, qkv decodes the same
greedy tokens as transformers in every family, the prefill logits agree, and every figure is there. The full
runs and their figures: docs/perf/decode_floor.md, docs/perf/prefill.md."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, out: Path, *extra: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--threads", "1",
                        "--out", str(out), *extra], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.slow
def test_decode_floor_quick(tmp_path):
    pytest.importorskip("transformers")
    run("decode_floor.py", tmp_path, "--ab", "--ab-step")
    result = json.loads((tmp_path / "decode_floor_quick.json").read_text())
    assert [r["family"] for r in result["rows"]] == ["gpt2", "llama", "t5", "bart"]
    for r in result["rows"]:
        assert r["tokens_equal"] == 1.0, r  # the same greedy tokens as transformers, step for step
        assert r["floor_ms"] > 0 and r["qkv_ms"] > 0 and r["hf_ms"] > 0
        assert r["qkv_x_floor"] == pytest.approx(r["qkv_ms"] / r["floor_ms"], rel=0.05)
        assert r["qkv_transposed_ms"] > 0  # --ab: the layout control ran (and gave the same tokens: tokens_equal)
        assert r["qkv_previous_step_ms"] > 0  # --ab-step: the step without step12c's fast paths ran (same tokens)
    assert result["meta"]["bandwidth_gbps"] > 0
    assert "| family |" in (tmp_path / "decode_floor_quick.md").read_text()


@pytest.mark.slow
def test_prefill_quick(tmp_path):
    pytest.importorskip("transformers")
    run("prefill.py", tmp_path, "--ablate")
    result = json.loads((tmp_path / "prefill_quick.json").read_text())
    assert {(r["family"], r["tokens"]) for r in result["rows"]} == {(f, n) for f in ("gpt2", "llama") for n in (16, 32)}
    for r in result["rows"]:
        assert r["max_abs_logit_diff"] < 1e-4, r  # the same function as transformers
        assert r["qkv_tok_s"] > 0 and r["hf_tok_s"] > 0
        assert r["full_top_s"] > 0  # --ablate: the full-top-block control ran (its logits are in the diff above)
        # --ablate: the control with new temporaries ran and gave the same logits bit for bit
        assert r["new_temps_s"] > 0 and r["new_temps_logits_equal"] is True
        assert r["qkv_cpu_s"] > 0 and r["hf_cpu_s"] > 0
