"""The smoke form of benchmarks/prefill.py (long-prompt prefill vs transformers): it runs end to end, writes
its JSON and table, and qkv's last-position logits agree with transformers' on the same weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_prefill_quick(tmp_path):
    pytest.importorskip("transformers")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "prefill.py"), "--quick", "--threads", "1",
                        "--ablate", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                       env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "prefill_quick.json").read_text())
    assert ({(r["family"], r["tokens"]) for r in result["rows"]}
            == {(f, n) for f in ("gpt2", "llama") for n in (16, 32)})
    for row in result["rows"]:
        # qkv (and its --ablate full-top-block control) compute the same function as transformers
        assert row["max_abs_logit_diff"] < 1e-4, row
        assert row["qkv_tok_s"] > 0 and row["hf_tok_s"] > 0 and row["full_top_s"] > 0
    assert "| model |" in (tmp_path / "prefill_quick.md").read_text()
