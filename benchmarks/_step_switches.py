"""The switches of the batch-1 decoding step's fast paths (step12c), for side-by-side A/B in one process.

    with previous_step():   # the step as before step12c: every switch off
        ...
    with previous_bf16():   # bf16 as before issue 12's bf16 passes (docs/perf/bf16_12d.md, bf16_12e.md): every bf16 switch off
        ...
    with previous_fp16_step():  # only the bf16 step's fp16 copy off (docs/perf/bf16_12e.md): torch's bf16 kernel
        ...
    with previous_12g():  # bf16 steps as before docs/perf/bf16_12g.md: the head's one row through torch's bf16
        ...                # kernel, a batch's gate and up through one fp16 copy each
Switches (module constants, read at every step): attention.STEP_SERIAL_MAX (the step's attention products on one
thread), linear.JOINT_STEP (a gated FFN's gate and up as one product), attention.STEP_JOINT_ROTATE (RoPE's query
and key heads rotated in one pass), norm.STEP_DOT_NORM (RMSNorm's mean square as one BLAS product).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import qkv.nn.attention as attention
import qkv.nn.linear as linear
import qkv.nn.norm as norm

# bf16 on a CPU without native bf16: products of several rows through fp32 tiles of the weight, the step's attention
# products in fp32, RMSNorm.step's bf16 row; the step's products of few rows through an fp16 copy (FP16_STEP)
FP16_STEP = ((linear, "STEP_BF16_VIA_FP16", False),)
BF16_SWITCHES = ((linear, "BF16_TILE_MIN_ROWS", 0), (attention, "STEP_BF16_FP32_PRODUCTS", False),
                 (norm, "STEP_DOT_NORM_BF16", False)) + FP16_STEP
# the fp16 routes of docs/perf/bf16_12g.md: a batch's gate and up through one joined fp16 copy, and a large weight's
# (the output head's) one-row product through its fp16 copy
ROUTES_12G = ((linear, "JOINT_STEP_BF16", False), (linear, "STEP_FP16_ONE_ROW_MIN_WEIGHT", 0))
SWITCHES = ((attention, "STEP_SERIAL_MAX", 0), (linear, "JOINT_STEP", False), (attention, "STEP_JOINT_ROTATE", False),
            (norm, "STEP_DOT_NORM", False))


@contextlib.contextmanager
def _off(switches: tuple) -> Iterator[None]:
    old = [getattr(mod, name) for mod, name, _ in switches]
    try:
        for mod, name, off in switches:
            setattr(mod, name, off)
        yield
    finally:
        for (mod, name, _), value in zip(switches, old):
            setattr(mod, name, value)


def previous_step() -> contextlib.AbstractContextManager[None]:
    """Every fast path of step12c off inside the block (restored after)."""
    return _off(SWITCHES)


def previous_bf16() -> contextlib.AbstractContextManager[None]:
    """Every bf16 path of issue 12's bf16 passes off inside the block (restored after): bf16 as before."""
    return _off(BF16_SWITCHES)


def previous_fp16_step() -> contextlib.AbstractContextManager[None]:
    """Only the bf16 step's fp16 copy (linear.STEP_BF16_VIA_FP16) off inside the block: torch's bf16 kernel."""
    return _off(FP16_STEP)


def previous_12g() -> contextlib.AbstractContextManager[None]:
    """Only the fp16 routes of docs/perf/bf16_12g.md off inside the block (restored after)."""
    return _off(ROUTES_12G)
