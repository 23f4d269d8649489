"""Mixed precision: fp32, bf16 autocast (CPU and CUDA), fp16 autocast + GradScaler (CUDA only), and auto.

Parameters, gradients and optimizer state stay fp32 in every mode ("master weights"); autocast runs
matrix products in the low-precision type. bf16 keeps fp32's exponent range, so it needs no loss scaling;
fp16 underflows small gradients, hence GradScaler (Micikevicius et al. 2018) — and fp16 matrix products
on CPU are not accelerated (about 2.5 GFLOP/s here), so fp16 on CPU is refused rather than crawled through.

auto (the default): bf16 on a GPU that supports it, fp32 on a CPU, decided by the device's capabilities. On a
CPU without native bf16 (AVX2 only) bf16 autocast's backward falls to torch's reference GEMM: a charlm trained
at 660 tokens/s against fp32's 3,910, so an explicit bf16 there runs with a warning that says so. With native
bf16 (AVX512-BF16, AMX) the gain depends on the width: 1.60x at 6 layers x 384 (docs/performance.md), none at
width 128 (0.80x, paired, loaded machine): auto keeps fp32's numerics there, and bf16 is one setting away.
"""

from __future__ import annotations

import contextlib
import warnings
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


def native_bf16_cpu() -> bool:
    """Does this CPU multiply bf16 natively (AVX512-BF16 or AMX tiles)? torch's own probes."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(callable(f := getattr(torch.cpu, name, None)) and f() for name in probes)


def auto_precision(device: torch.device) -> str:
    """precision=auto on `device`: bf16 on a GPU that supports it, else fp32 (the module docstring)."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


SLOW_BF16_NOTE = ("precision=bf16 on a CPU without native bf16 (AVX512-BF16 / AMX): autocast's backward "
                  "runs torch's reference GEMM, ~6x slower than fp32 (measured on AVX2); precision=auto or "
                  "fp32 is faster here")


class Precision:
    """autocast() context for forward passes and the optional GradScaler."""

    def __init__(self, precision: str, device: torch.device) -> None:
        if precision not in (*DTYPES, "auto"):
            raise ConfigError(f"precision {precision!r} is not one of {[*DTYPES, 'auto']}")
        if precision == "auto":
            precision = auto_precision(device)
        if precision == "bf16" and device.type == "cpu" and not native_bf16_cpu():
            warnings.warn(SLOW_BF16_NOTE, stacklevel=3)
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
