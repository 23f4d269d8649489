"""The time budget of equal-time suites (budget_s) counts the wall clock or the run's own CPU time
(budget_clock: cpu): waiting (another job holding the core) spends the first, not the second."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from qkv.config import ConfigError
from qkv.experiments.runner import _budget_callback
from qkv.experiments.suite import load_suite


def _stops_after_sleeping(clock: str, budget: float = 0.2) -> bool:
    cb = _budget_callback(budget, clock)
    trainer = SimpleNamespace(should_stop=False)
    cb.on_fit_start(trainer)
    time.sleep(2 * budget)  # elapsed time without CPU time, like a process that is waiting for a busy core
    cb.on_step_end(trainer, 1, {})
    return trainer.should_stop


def test_wall_budget_counts_waiting_cpu_budget_does_not():
    assert _stops_after_sleeping("wall") is True
    assert _stops_after_sleeping("cpu") is False


def test_cpu_budget_counts_work():
    cb = _budget_callback(0.05, "cpu")
    trainer = SimpleNamespace(should_stop=False)
    cb.on_fit_start(trainer)
    t0 = time.process_time()
    while time.process_time() - t0 < 0.1:  # busy: CPU time passes
        sum(range(1000))
    cb.on_step_end(trainer, 1, {})
    assert trainer.should_stop is True


def test_budget_clock_is_checked():
    base = {"name": "x", "model": {"preset": "gpt-nano"}, "task": {"name": "reverse"}, "budget_s": 1}
    assert load_suite(base).budget_clock == "wall"
    assert load_suite("08a_lstm_listops").budget_clock == "cpu"
    with pytest.raises(ConfigError):
        load_suite({**base, "budget_clock": "gpu"})
