"""Position-wise feed-forward network: FFN(x) = W2 act(W1 x) (Vaswani 2017, eq. 2), or a gated variant
W2 (act(W3 x) * W1 x) (Shazeer 2020, "GLU Variants Improve Transformer").

Every activation is one entry of ACTIVATIONS: (function, gated). The training forward and the decoding step
both read that table, so a new activation is one line here and works in both paths.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn.linear import Linear, joint_step


class Activation(NamedTuple):
    fn: Callable[[Tensor], Tensor]
    gated: bool  # True: act(gate(x)) * up(x), with a third (gate) projection


ACTIVATIONS: dict[str, Activation] = {
    "relu": Activation(F.relu, False),
    "gelu": Activation(F.gelu, False),  # exact erf (BERT, the original Transformer's successors)
    "gelu_tanh": Activation(partial(F.gelu, approximate="tanh"), False),  # GPT-2's approximation
    "swiglu": Activation(F.silu, True),  # Llama, Mistral, Qwen: silu(W3 x) * W1 x
    "silu": Activation(F.silu, False),  # "swish": Marian / OPUS-MT
    "geglu_tanh": Activation(partial(F.gelu, approximate="tanh"), True),  # T5 v1.1 / Flan "gated-gelu" (gelu_new)
}


class FeedForward(nn.Module):
    """Gated variants have three projections (up, gate, down); their hidden size is usually 2/3 of the
    others' for equal parameters."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", bias: bool = True, dropout: float = 0.0):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown ffn activation {activation!r}; choose one of {tuple(ACTIVATIONS)}")
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.up = Linear(d_model, d_ff, bias=bias)
        self.gate = Linear(d_model, d_ff, bias=bias) if self.act.gated else None
        self.down = Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.up(x)
        if self.gate is None:
            h = self.act.fn(h)
        elif torch.is_grad_enabled():
            h = self.act.fn(self.gate(x)) * h
        else:  # inference (a prefill): multiply into the activation's fresh output, no third (T, d_ff) tensor
            h = self.act.fn(self.gate(x)).mul_(h)
        return self.down(self.dropout(h))

    def step(self, x: Tensor) -> Tensor:
        """The same function for a decoding step (inference: pre-transposed weights, no dropout). Submodules
        are read from _modules: nn.Module.__getattr__ costs ~1 us a lookup, on every layer of every step."""
        mods = self._modules
        gate = mods.get("gate")  # absent (a plain None) for ungated activations
        if gate is not None:
            # one row (batch-1 decoding): gate and up as one matrix-vector product over a joined copy
            gu = joint_step(self, x, (gate, mods["up"]))
            if gu is not None:
                g, h = gu.split_with_sizes([gate.out_features, gate.out_features], dim=-1)
                return mods["down"].step(self.act.fn(g).mul_(h))
        h = mods["up"].step(x)
        if gate is None:
            h = self.act.fn(h)
        elif torch.is_grad_enabled():  # step outside no_grad: no in-place op on a tensor autograd may need
            h = self.act.fn(gate.step(x)) * h
        else:
            h = self.act.fn(gate.step(x)).mul_(h)  # into the activation's fresh output: one allocation fewer
        return mods["down"].step(h)
