"""Feed-forward variants against their formulas written with the math module."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.nn.ffn import FeedForward


def elementwise(f, t: torch.Tensor) -> torch.Tensor:
    return torch.tensor([f(float(v)) for v in t.detach().flatten()], dtype=torch.float64).view(t.shape)


ACTS = {
    "relu": lambda a: max(a, 0.0),
    "gelu": lambda a: 0.5 * a * (1 + math.erf(a / math.sqrt(2))),  # exact GELU (BERT)
    # GPT-2
    "gelu_tanh": lambda a: 0.5 * a * (1 + math.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3))),
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


