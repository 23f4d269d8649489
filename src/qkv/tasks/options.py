"""What every task's options dataclass shares: it is the run config's `task:` section, so a ConfigError about
one of its fields names the key as the user writes it (`task.max_len must be at least min_len (10), got 5`).
"""

from __future__ import annotations

from typing import Any

from qkv.config import ConfigError, check_fields

SECTION = "task"


def check_option(ok: bool, key: str, problem: str) -> None:
    """A rule of a task's options that no one field's bounds say: else a ConfigError about `task.<key>`."""
    if not ok:
        raise ConfigError(problem, key, SECTION)


def check_options(options: Any, *ranges: tuple[str, str]) -> None:
    """Every field of a task's `options` of its type and inside its declared bounds and choices
    (check_fields), and each (low, high) pair of `ranges` in order (min_len <= max_len)."""
    check_fields(options, SECTION)
    for low, high in ranges:
        check_option(getattr(options, low) <= getattr(options, high), high,
                     f"must be at least {low} ({getattr(options, low)}), got {getattr(options, high)}")
