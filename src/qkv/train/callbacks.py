"""Callbacks: how experiments hook into the one training loop (minGPT's trainer callbacks, with names).

Subclass Callback and override what you need; every hook receives the Trainer, which exposes `model`
(the unwrapped module), `optimizer`, `cfg`, `state` (a TrainState: step, counters, best), `step` (completed
updates) and `should_stop` (set it True to end training after the current step; a final checkpoint is
still written).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from qkv.train.config import TrainConfig
from qkv.train.state import TrainState


class TrainerView(Protocol):
    """What a hook sees of qkv.train.Trainer (a protocol, so that this module stands below trainer.py)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    cfg: TrainConfig
    state: TrainState
    should_stop: bool

    @property
    def step(self) -> int: ...


class Callback:
    def on_fit_start(self, trainer: TrainerView) -> None: ...

    def on_step_start(self, trainer: TrainerView, step: int) -> None:
        """Before update number `step` (1-based) fetches its micro-batches."""

    def on_batch(self, trainer: TrainerView, step: int, micro: int,
                 batch: dict[str, Any]) -> dict[str, Any] | None:
        """May return a modified micro-batch (already truncated and on the device); None keeps `batch`,
        which the callback may have changed in place."""
        return batch

    def on_after_backward(self, trainer: TrainerView, step: int) -> None:
        """Gradients are complete (accumulated, token-normalised, unscaled), not yet checked or clipped."""

    def on_step_end(self, trainer: TrainerView, step: int, record: dict[str, Any]) -> None:
        """After update `step`; `record` holds this step's metrics (logged every log_every steps)."""

    def on_eval(self, trainer: TrainerView, step: int, metrics: dict[str, float]) -> None: ...

    def on_checkpoint(self, trainer: TrainerView, step: int, path: Path) -> None: ...

    def on_fit_end(self, trainer: TrainerView, summary: dict[str, Any]) -> None: ...


class LambdaCallback(Callback):
    """Callback from keyword functions: LambdaCallback(on_step_end=lambda tr, step, rec: ...)."""

    def __init__(self, **hooks: Callable[..., Any]) -> None:
        for name, fn in hooks.items():
            if not hasattr(Callback, name):
                raise ValueError(f"unknown callback hook {name!r}")
            setattr(self, name, fn)


class StopAt(Callback):
    """End training after update `step` (used to split a run in two for resume tests and time limits)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: TrainerView, step: int, record: dict[str, Any]) -> None:
        if step >= self.step:
            trainer.should_stop = True
