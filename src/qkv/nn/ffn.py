"""Position-wise feed-forward network: FFN(x) = W2 act(W1 x) (Vaswani 2017, eq. 2), or a gated variant
W2 (act(W3 x) * W1 x) (Shazeer 2020, "GLU Variants Improve Transformer").

Every activation is one entry of ACTIVATIONS: (function, gated), so a new activation is one line here. The
decoding step calls the same forward (eval mode: no dropout).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn.linear import Linear


class Activation(NamedTuple):
    fn: Callable[[Tensor], Tensor]
    gated: bool  # True: act(gate(x)) * up(x), with a third (gate) projection


ACTIVATIONS: dict[str, Activation] = {
    "relu": Activation(F.relu, False),
    "gelu": Activation(F.gelu, False),  # exact erf (BERT, the original Transformer's successors)
    "gelu_tanh": Activation(partial(F.gelu, approximate="tanh"), False),  # GPT-2's approximation
    "swiglu": Activation(F.silu, True),  # Llama, Mistral, Qwen: silu(W3 x) * W1 x
    "silu": Activation(F.silu, False),  # "swish": Marian / OPUS-MT
    "geglu_tanh": Activation(partial(F.gelu, approximate="tanh"), True),  # T5 v1.1 / Flan "gated-gelu"
    # OpenAI CLIP's GELU approximation
    "quick_gelu": Activation(lambda x: x * torch.sigmoid(1.702 * x), False),
}
UNGATED = tuple(name for name, a in ACTIVATIONS.items() if not a.gated)  # those of a plain two-layer MLP


class FeedForward(nn.Module):
    """Gated variants have three projections (up, gate, down); their hidden size is usually 2/3 of the
    others' for equal parameters."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", bias: bool = True,
                 dropout: float = 0.0):
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
        h = self.act.fn(h) if self.gate is None else self.act.fn(self.gate(x)) * h
        return self.down(self.dropout(h))
