"""--only: which runs of a suite a filter selects (whole key=value items of a variant's name, or variant
names), and the error that lists what it can name when it selects none."""

from __future__ import annotations

from typing import Any

import yaml

from qkv.config import ConfigError
from qkv.experiments.suite import RunSpec, Suite, format_value


def _only_items(spec: RunSpec) -> set[str]:
    """What --only can name of a run: its whole variant name, its explicit variant's name (alone or as
    variant=NAME), and each swept value as key=value, written as in the table and the folder names."""
    items = {spec.variant}
    for k, v in spec.values.items():
        items.add(f"{k}={format_value(v)}")
        if k == "variant":
            items.add(str(v))
    return items


def _same_value(raw: str, value: Any) -> bool:
    """`raw` (typed after key= in --only) names `value`: as displayed (True, 0.001), or as YAML reads it
    (true, 1e-3, 1.0 for 1), without taking a bool for a number."""
    if raw == format_value(value):
        return True
    try:
        parsed = yaml.safe_load(raw)
    except yaml.YAMLError:
        return False
    if isinstance(parsed, bool) or isinstance(value, bool):
        return parsed is value
    if isinstance(value, (int, float)):
        try:
            return float(raw) == float(value)
        except ValueError:
            return False
    return parsed == value


def matches_only(spec: RunSpec, only: str) -> bool:
    """--only FILTER: comma-separated items, each a whole key=value of the variant's name (n_heads=1 is not
    n_heads=16) or an explicit variant's name; a run is selected when it has every item."""
    if only.strip() == spec.variant:
        return True
    items = _only_items(spec)
    for item in (w.strip() for w in only.split(",")):
        if not item or item in items:
            continue
        key, eq, raw = item.partition("=")
        if not (eq and key.strip() in spec.values and _same_value(raw.strip(), spec.values[key.strip()])):
            return False
    return True


def select_runs(suite: Suite, specs: list[RunSpec], only: str | None) -> set[int]:
    """The indices of the runs --only selects (all without it); a filter that selects none is an error that
    lists what it can name."""
    if not only:
        return set(range(len(specs)))
    chosen = {i for i, spec in enumerate(specs) if matches_only(spec, only)}
    if not chosen:
        names = list(dict.fromkeys(spec.variant for spec in specs))
        raise ConfigError(f"--only {only!r} matches no run of suite {suite.name!r}: give comma-separated "
                          f"whole key=value items or variant names of its variants: {'; '.join(names)}")
    return chosen
