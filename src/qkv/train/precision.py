"""Mixed precision: fp32, bf16 autocast (CPU and CUDA), fp16 autocast + GradScaler (CUDA only).

Parameters, gradients and optimizer state stay fp32 in every mode ("master weights"); autocast runs
matrix products in the low-precision type. bf16 keeps fp32's exponent range, so it needs no loss scaling;
fp16 underflows small gradients, hence GradScaler (Micikevicius et al. 2018) — and fp16 matrix products
on CPU are not accelerated (about 2.5 GFLOP/s here), so fp16 on CPU is refused rather than crawled through.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from qkv.config import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
    return dev


class Precision:
    """autocast() context for forward passes and the optional GradScaler."""

    def __init__(self, precision: str, device: torch.device) -> None:
        if precision not in DTYPES:
            raise ConfigError(f"precision {precision!r} is not one of {list(DTYPES)}")
        if precision == "fp16" and device.type != "cuda":
            raise ConfigError("precision=fp16 needs a CUDA GPU (GradScaler); on CPU use bf16 or fp32")
        if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("precision=bf16: this GPU does not support bfloat16; use fp16 or fp32")
        self.name = precision
        self.device = device
        self.dtype = DTYPES[precision]
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)  # skips the update itself when the scaled grads overflowed
            self.scaler.update()
        else:
            optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
