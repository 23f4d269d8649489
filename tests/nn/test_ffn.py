"""Feed-forward variants against their formulas written with the math module."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from qkv.nn.ffn import FeedForward


def elementwise(f, t: torch.Tensor) -> torch.Tensor:
    return torch.tensor([f(float(v)) for v in t.detach().flatten()], dtype=torch.float64).view(t.shape)


ACTS = {
    "relu": lambda a: max(a, 0.0),
    "gelu": lambda a: 0.5 * a * (1 + math.erf(a / math.sqrt(2))),  # exact GELU (BERT)
    "gelu_tanh": lambda a: 0.5 * a * (1 + math.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3))),  # GPT-2
}


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "swiglu"])
def test_ffn_formula(activation):
    ffn = FeedForward(8, 12, activation)
    with torch.no_grad():
        for p in ffn.parameters():
            p.normal_()
    x = torch.randn(2, 3, 8)
    W1, b1 = ffn.up.weight.double(), ffn.up.bias.double()
    W2, b2 = ffn.down.weight.double(), ffn.down.bias.double()
    h = x.double() @ W1.T + b1
    if activation == "swiglu":  # W2 (silu(W_gate x) * W1 x)  (Shazeer 2020)
        g = x.double() @ ffn.gate.weight.double().T + ffn.gate.bias.double()
        a = elementwise(lambda z: z / (1 + math.exp(-z)), g) * h
    else:
        assert ffn.gate is None
        a = elementwise(ACTS[activation], h)
    ref = a @ W2.T + b2
    torch.testing.assert_close(ffn(x).double(), ref, atol=1e-4, rtol=1e-5)


def test_gelu_variants_differ():
    # gelu and gelu_tanh must be different functions (GPT-2 parity needs the tanh one)
    z = torch.linspace(-3, 3, 61, dtype=torch.float64)
    assert (elementwise(ACTS["gelu"], z) - elementwise(ACTS["gelu_tanh"], z)).abs().max() > 1e-5


def test_ffn_without_bias_and_unknown_activation():
    ffn = FeedForward(4, 8, "swiglu", bias=False)
    assert ffn.up.bias is None and ffn.down.bias is None and ffn.gate.bias is None
    with pytest.raises(ValueError, match="unknown ffn activation"):
        FeedForward(4, 8, "tanh")


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "swiglu", "silu", "geglu_tanh"])
def test_inference_forward_in_place_activation_gives_the_same_values(monkeypatch, activation):
    """Without autograd the activation runs in place on a projection's fresh output (ffn.ACT_IN_PLACE): the same
    values bit for bit as into a new tensor and as under autograd; a forward hook on that projection still sees
    the projection's own output (the in-place form is skipped then)."""
    import qkv.nn.ffn as FF

    torch.manual_seed(0)
    ffn = FeedForward(16, 24, activation).eval()
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        fast = ffn(x)
        monkeypatch.setattr(FF, "ACT_IN_PLACE", False)
        slow = ffn(x)
        monkeypatch.setattr(FF, "ACT_IN_PLACE", True)
    assert torch.equal(fast, slow) and torch.equal(fast, ffn(x).detach())
    with torch.no_grad():  # the in-place forms are plain functions: a module still pickles (and runs the same)
        assert torch.equal(pickle.loads(pickle.dumps(ffn))(x), fast)
    source = ffn.gate if ffn.gate is not None else ffn.up
    seen = []
    source.register_forward_hook(lambda m, args, out: seen.append(out))
    with torch.no_grad():
        assert torch.equal(ffn(x), fast)
    torch.testing.assert_close(seen[0], torch.nn.functional.linear(x, source.weight, source.bias), rtol=0, atol=0)
