"""benchmarks/train_floor.py --quick: the step's GEMMs are recorded completely (their FLOPs equal 6 N P, the
training FLOPs of every linear layer, lm head included), the comparison of the two steps' kernels tells a
nanoGPT-like model with flash attention (the same calls) from one with hand-written attention (other calls), and
the output has the floor ratios."""

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

# the stand-in's hand-written attention replaced by SDPA with is_causal, as nanoGPT's model.py does it
MANUAL = '''        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.h)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(B, T, C))'''
FLASH = '''        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))'''


def run(tmp_path: Path, source: str) -> dict:
    model_py = tmp_path / "nano" / "model.py"
    model_py.parent.mkdir(parents=True, exist_ok=True)
    model_py.write_text(source, encoding="utf-8")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_floor.py"), "--nanogpt", str(model_py),
                        "--quick", "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "nanoGPT step / floor: the largest speedup" in (out / "train_floor_quick.md").read_text()
    return json.loads((out / "train_floor_quick.json").read_text())


def test_quick_floor_with_flash_and_with_hand_written_attention(tmp_path):
    assert MANUAL in STAND_IN
    flash = run(tmp_path / "flash", STAND_IN.replace(MANUAL, FLASH))
    s = flash["config"]
    n, d, layers, vocab = s["batch"] * s["block"], s["n_embd"], s["n_layer"], s["vocab"]
    # forward, input gradient, weight gradient of every linear (12 d^2 per block) and of the tied lm head
    assert flash["gflop"]["gemm"] * 1e9 == pytest.approx(6 * n * (12 * d * d * layers + d * vocab), rel=1e-12)
    assert flash["calls"] == {"gemm": 3 * (4 * layers + 1), "attention": 2 * layers,
                              "gemm_nanogpt": 3 * (4 * layers + 1), "attention_nanogpt": 2 * layers}
    assert flash["same_gemm_and_attention_calls"] is True
    loss = flash["fp32_first_step_loss"]
    assert abs(loss["qkv step"] - loss["nanoGPT step"]) < 1e-4  # the same function on the same weights
    r = flash["ratios"]
    # the kernels replayed alone take less than the whole step that runs them (and more than nothing)
    assert 0 < r["kernels / whole step, qkv (both clocked)"]["max"] < 1
    assert 0 < r["kernels / whole step, nanoGPT (both clocked)"]["max"] < 1
    assert set(flash["per_round_ms"]) >= {"the step's GEMMs alone", "the step's attention kernels alone"}
    manual = run(tmp_path / "manual", STAND_IN)
    assert manual["same_gemm_and_attention_calls"] is False  # bmm + softmax instead of the flash kernel
    assert manual["calls"]["attention_nanogpt"] == 0 and manual["calls"]["gemm_nanogpt"] > manual["calls"]["gemm"]


def test_the_sigmoid_form_of_the_tanh_gelu_is_the_same_function():
    """The candidate measured by the benchmark: equal to F.gelu(approximate="tanh") in value and gradient
    (float64), and its hand-written backward passes gradcheck."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_floor import SigmoidGeluTanh

    x = torch.linspace(-12, 12, 301, dtype=torch.float64).requires_grad_()
    g = torch.cos(torch.arange(301, dtype=torch.float64))
    y, ref = SigmoidGeluTanh.apply(x), F.gelu(x, approximate="tanh")
    assert torch.allclose(y, ref, rtol=1e-12, atol=1e-14)
    assert torch.allclose(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(ref, x, g)[0], rtol=1e-12, atol=1e-14)
    assert torch.autograd.gradcheck(SigmoidGeluTanh.apply, (torch.randn(4, 7, dtype=torch.float64, requires_grad=True),))
    x32 = torch.randn(64, 96)
    assert (SigmoidGeluTanh.apply(x32) - F.gelu(x32, approximate="tanh")).abs().max() < 1e-6
