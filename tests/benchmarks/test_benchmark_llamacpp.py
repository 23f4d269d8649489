"""The smoke forms of benchmarks/llamacpp.py (qkv's decoding against llama.cpp on the same weights): qkv's
side runs end to end without llama.cpp and writes its figures with the peer's rows "n/a"; where a separate
environment with llama-cpp-python is named by $QKV_LLAMACPP_PYTHON, the GGUF files written from the same
Hugging Face folder give llama.cpp the same logits and greedy tokens as qkv. The full run and its figures:
docs/performance.md."""

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest


def run(run_benchmark: Callable, out: Path, peer_python: str) -> dict:
    run_benchmark("llamacpp", "--quick", "--threads", "1", "--llamacpp-python", peer_python, "--out",
                  str(out), timeout=900)
    return json.loads((out / "llamacpp_quick.json").read_text())


@pytest.mark.slow
def test_llamacpp_benchmark_quick_without_peer(tmp_path, run_benchmark):
    pytest.importorskip("transformers")
    result = run(run_benchmark, tmp_path, "")
    rows = {r["qkv"]: r for r in result["rows"]}
    assert [(r["qkv"], r["llamacpp"]) for r in result["rows"]] == [
        ("fp32", "F32"), ("fp32 compiled", "F32"), ("bf16", "BF16"), ("bf16 compiled", "BF16"),
        ("int8", "Q8_0"), ("int8 compiled", "Q8_0"), ("int8 from fp32", "Q8_0"),
        ("int8 from fp32 compiled", "Q8_0")]
    for name in rows:
        assert rows[name]["qkv_ms"] > 0 and rows[name]["qkv_floor_ms"] > 0
        assert rows[name]["llamacpp_ms"] is None and rows[name]["ratio"] is None
    # the floors follow the bytes read per token: bf16 half of fp32's; int8 less again (its projections a byte
    # a weight plus scales; the embedding, norms and a tiny model's large vocabulary share stay bf16)
    assert rows["bf16"]["qkv_floor_ms"] == pytest.approx(0.5 * rows["fp32"]["qkv_floor_ms"], rel=0.02)
    assert rows["int8"]["qkv_floor_ms"] < 0.9 * rows["bf16"]["qkv_floor_ms"]
    # from an fp32 folder the same int8 projections, but the unquantised tensors stay fp32
    floor = {name: row["qkv_floor_ms"] for name, row in rows.items()}
    assert floor["int8"] < floor["int8 from fp32"] < floor["fp32"]
    assert result["meta"]["llamacpp"] is None and "llamacpp-python" in result["meta"]["llamacpp_absent"]
    assert "| fp32 | F32 |" in (tmp_path / "llamacpp_quick.md").read_text()


@pytest.mark.slow
def test_llamacpp_benchmark_quick_with_peer(tmp_path, run_benchmark):
    pytest.importorskip("transformers")
    peer = os.environ.get("QKV_LLAMACPP_PYTHON")
    if not peer:
        pytest.skip("llama.cpp is an optional peer: set QKV_LLAMACPP_PYTHON to a venv's python with "
                    "llama-cpp-python")
    result = run(run_benchmark, tmp_path, peer)
    rows = {r["llamacpp"]: r for r in result["rows"]}
    assert result["meta"]["llamacpp"]["ready"]
    assert all(r["llamacpp_ms"] > 0 for r in rows.values())
    # fp32 in both: the GGUF's weights (q/k rows permuted for llama.cpp's RoPE) give qkv's logits and tokens
    assert rows["F32"]["logits_max_diff"] < 1e-3 * rows["F32"]["logits_scale"]
    assert rows["F32"]["tokens_equal"] == 1.0
    # bf16 weights and activations in both: close, not equal
    assert rows["BF16"]["logits_max_diff"] < 0.05 * rows["BF16"]["logits_scale"]
