"""Position-wise feed-forward network: FFN(x) = W2 act(W1 x) (Vaswani 2017, eq. 2), or SwiGLU."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn.linear import Linear

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "swiglu")


class FeedForward(nn.Module):
    """relu / gelu (exact erf, BERT) / gelu_tanh (GPT-2's approximation) / swiglu (Shazeer 2020:
    W2 (silu(W1 x) * W3 x); its hidden size is usually 2/3 of the others' for equal parameters)."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", bias: bool = True, dropout: float = 0.0):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown ffn activation {activation!r}; choose one of {ACTIVATIONS}")
        self.activation = activation
        self.up = Linear(d_model, d_ff, bias=bias)
        self.gate = Linear(d_model, d_ff, bias=bias) if activation == "swiglu" else None
        self.down = Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.up(x)
        if self.activation == "relu":
            h = F.relu(h)
        elif self.activation == "gelu":
            h = F.gelu(h)
        elif self.activation == "gelu_tanh":
            h = F.gelu(h, approximate="tanh")
        else:
            h = F.silu(self.gate(x)) * h
        return self.down(self.dropout(h))
