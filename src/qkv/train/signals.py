"""SIGINT / SIGTERM during Trainer.fit(): finish the current step, checkpoint it, stop. A mixin of Trainer:
the handlers only set a flag, and the loop acts on it between steps (under DDP/FSDP once every rank
agrees)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import torch

from qkv.train import distributed as dist_


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped training: the current step was completed and checkpointed first.
    A KeyboardInterrupt, so code that records other exceptions as failed runs lets it through."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        name = signal.Signals(signum).name
        where = f"checkpoint saved to {checkpoint}" if checkpoint else "no checkpoint could be saved"
        super().__init__(f"interrupted by {name} at step {step}; {where}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint



class SignalStop:
    """The signal half of Trainer: `_signal` is the signal this process received, `_signal_agreed` whether
    some rank received one (all-reduced with each step's loss)."""

    _signal: int | None
    _signal_agreed: bool
    _old_handlers: dict[int, Any]
    dist: Any
    device: torch.device

    def _install_signal_handlers(self) -> None:
        self._signal, self._signal_agreed = None, False
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._signal is not None:  # a second one: stop now, without a checkpoint
            self._restore_signal_handlers()
            raise KeyboardInterrupt
        self._signal = signum  # only a flag: the loop logs and saves at the end of the current step

    def _interrupted(self, final: bool = False) -> bool:
        """Whether to stop for a signal. Under DDP/FSDP every rank must agree (saving is collective): the
        flag travels with each step's loss all-reduce, and once more at the very end (final=True)."""
        if not self.dist.enabled:
            return self._signal is not None
        if final and not self._signal_agreed:
            flag = torch.tensor([1.0 if self._signal is not None else 0.0], device=self.device)
            self._signal_agreed = dist_.all_reduce_sum(flag, self.dist).item() > 0
        return self._signal_agreed
