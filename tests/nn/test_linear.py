"""qkv's Linear is torch's nn.Linear: the same function, parameters and state-dict keys."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qkv.nn.linear import Linear


def test_linear_module_is_a_drop_in_nn_linear():
    layer = Linear(16, 8)
    assert isinstance(layer, torch.nn.Linear)
    assert list(layer.state_dict()) == ["weight", "bias"]
    x = torch.randn(2, 70, 16, dtype=torch.float64)
    layer = layer.double()
    want = x @ layer.weight.T + layer.bias  # the formula, in float64
    torch.testing.assert_close(layer(x), want)
    torch.testing.assert_close(F.linear(x, layer.weight, layer.bias), want)
