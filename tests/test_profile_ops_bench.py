"""benchmarks/profile_ops.py --quick: both comparisons run end to end and the tables carry the kernels both
sides share (equal call counts of the flash-attention kernel: the same attention path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train_vs_nanogpt_bench import STAND_IN  # noqa: E402


def run(tmp_path: Path, *args: str) -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_ops.py"), *args, "--quick", "--threads", "1",
                        "--min-ms", "0", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(next(tmp_path.glob("profile_*_quick.json")).read_text())


def calls(result: dict, op: str, side: str) -> float:
    return next((r[f"{side} calls"] for r in result["rows"] if r["op"] == op), 0)


@pytest.mark.slow
def test_prefill_profile_quick(tmp_path):
    res = run(tmp_path, "prefill", "--family", "llama")
    flash = "aten::_scaled_dot_product_flash_attention_for_cpu"
    # every layer but the top one (last_only: one query, two small products) through the same kernel
    assert calls(res, flash, "qkv") == calls(res, flash, "transformers") - 1 > 0
    assert res["total_ms"]["qkv"] > 0 and "| op |" in next(tmp_path.glob("*.md")).read_text()


def test_train_profile_quick(tmp_path):
    model_py = tmp_path / "model.py"
    model_py.write_text(STAND_IN, encoding="utf-8")
    res = run(tmp_path / "out", "train", "--nanogpt", str(model_py))
    assert set(res["total_ms"]) == {"qkv", "qkv exact GELU", "nanoGPT"}
    assert calls(res, "aten::mm", "qkv") == calls(res, "aten::mm", "nanoGPT") > 0


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--dtype", "bfloat16", "--batch", "4")])
def test_step_profile_quick(tmp_path, extra):
    res = run(tmp_path, "step", "--family", "llama", *extra)
    # one new token through each library's 2 layers: both read the KV cache and call the same matrix kernels
    assert calls(res, "aten::mm", "qkv") > 0 and calls(res, "aten::mm", "transformers") > 0
    assert res["aten_calls"]["qkv"] > 0 and "decoding step" in res["what"]
    if extra:
        assert "batch 4, bfloat16" in res["what"]


def test_beam_profile_quick(tmp_path):
    res = run(tmp_path, "beam")
    # both libraries run the output projection and a top-k every step of the same beam search
    assert calls(res, "aten::topk", "qkv") > 0 and calls(res, "aten::topk", "transformers") > 0
    assert res["total_ms"]["qkv"] > 0 and "beam search" in res["what"]
