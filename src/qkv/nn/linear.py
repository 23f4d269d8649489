"""The Transformer's projection: y = x W^T + b, torch's own nn.Linear.

qkv's layers build their projections from `Linear` rather than `nn.Linear` so that there is one name for
"a projection of the model": LoRA (qkv.finetune.lora) wraps these modules, weight-only quantization
(qkv.nn.quant) swaps them, and the analyses find them by type. The arithmetic is torch's: its BLAS / oneDNN
kernels when run eagerly, Inductor's code under torch.compile, cuBLAS on a GPU. qkv keeps no kernel or
per-CPU route of its own: speed comes from those portable mechanisms (see docs/performance.md).
"""

from __future__ import annotations

from torch import nn


class Linear(nn.Linear):
    """nn.Linear, unchanged: the same parameters, state-dict keys (`weight` (out, in), `bias` (out,)) and
    kernels."""
