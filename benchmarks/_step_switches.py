"""The switches of the batch-1 decoding step's fast paths (step12c), for side-by-side A/B in one process.

    with previous_step():   # the step as before step12c: every switch off
        ...
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

SWITCHES = ((attention, "STEP_SERIAL_MAX", 0), (linear, "JOINT_STEP", False), (attention, "STEP_JOINT_ROTATE", False),
            (norm, "STEP_DOT_NORM", False))


@contextlib.contextmanager
def previous_step() -> Iterator[None]:
    """Every fast path of step12c off inside the block (restored after)."""
    old = [getattr(mod, name) for mod, name, _ in SWITCHES]
    try:
        for mod, name, off in SWITCHES:
            setattr(mod, name, off)
        yield
    finally:
        for (mod, name, _), value in zip(SWITCHES, old):
            setattr(mod, name, value)
