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
    fn_: Callable[[Tensor], Tensor] | None = None  # the same kernel in place (inference: no new (T, d_ff) tensor)


def _silu_(x: Tensor) -> Tensor:
    return F.silu(x, inplace=True)


def _gelu_(x: Tensor) -> Tensor:  # module-level functions, not partials of torch.ops: modules stay picklable
    return torch.ops.aten.gelu_(x)


def _gelu_tanh_(x: Tensor) -> Tensor:
    return torch.ops.aten.gelu_(x, approximate="tanh")


ACTIVATIONS: dict[str, Activation] = {
    "relu": Activation(F.relu, False, F.relu_),
    "gelu": Activation(F.gelu, False, _gelu_),  # exact erf (BERT, the original Transformer's successors)
    "gelu_tanh": Activation(partial(F.gelu, approximate="tanh"), False, _gelu_tanh_),  # GPT-2's approximation
    "swiglu": Activation(F.silu, True, _silu_),  # Llama, Mistral, Qwen: silu(W3 x) * W1 x
    "silu": Activation(F.silu, False, _silu_),  # "swish": Marian / OPUS-MT
    "geglu_tanh": Activation(partial(F.gelu, approximate="tanh"), True, _gelu_tanh_),  # T5 v1.1 / Flan "gated-gelu"
}
# The inference forward (no autograd) applies the activation in place on a projection's fresh output where no
# forward hook of that projection sees it: the same values, one (T, d_ff) tensor fewer per layer, whose allocation
# and first-touch page faults a long prompt's prefill pays (docs/perf/pre15c.md). False: into a new tensor, as
# before (benchmarks/prefill.py --ablate).
ACT_IN_PLACE = True


def _global_forward_hooks() -> dict:
    """The forward hooks registered for every module (torch.nn.modules.module.register_module_forward_hook)."""
    return getattr(nn.modules.module, "_global_forward_hooks", None) or {}


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
            h = self._activate(h, self.up)
        elif torch.is_grad_enabled():
            h = self.act.fn(self.gate(x)) * h
        else:  # inference (a prefill): multiply into the activation's output, no third (T, d_ff) tensor
            h = self._activate(self.gate(x), self.gate).mul_(h)
        return self.down(self.dropout(h))

    def _activate(self, h: Tensor, source: nn.Module) -> Tensor:
        """act(h) for forward(); h is the fresh output of the projection `source`. Without autograd it is
        overwritten in place unless a forward hook may hold it (a module's or a global one)."""
        if ACT_IN_PLACE and self.act.fn_ is not None and not torch.is_grad_enabled() \
                and not (source._forward_hooks or _global_forward_hooks()):
            return self.act.fn_(h)
        return self.act.fn(h)

    def step(self, x: Tensor) -> Tensor:
        """The same function for a decoding step (inference: pre-transposed weights, no dropout). Submodules
        are read from _modules: nn.Module.__getattr__ costs ~1 us a lookup, on every layer of every step."""
        mods = self._modules
        gate = mods.get("gate")  # absent (a plain None) for ungated activations
        if gate is not None:
            # gate and up as one product over a joined copy (fp32: one row; bf16: a batch's rows; linear.joint_step)
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
