"""The speedrun folder's record, DIR/speedrun.json: the profile it runs and each completed phase's figures.

A phase is complete when, and only when, its entry is in this file; the entry is written (atomically) after
everything the phase makes is written (atomically), so a kill or a full disk mid-phase leaves the phase
unrecorded and the next run does it again (a partial pretrain or fine-tune continues from its newest
checkpoint). The file is written first of all, so a folder is recognised as a speedrun's before anything
else is in it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qkv.config import ConfigError
from qkv.run.folders import check_out_folder
from qkv.storage import atomic_write_json

STATE_FILE = "speedrun.json"
PHASES = ("data", "tokenizer", "pretrain", "sft", "evaluate", "report")


def read_state(out: Path) -> dict[str, Any] | None:
    """The record of OUT, None when there is none; a record that is not the speedrun's is an error."""
    path = out / STATE_FILE
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"--out {out}: {STATE_FILE} is not readable JSON ({e}); choose another "
                          "--out") from None
    if not isinstance(state, dict) or not isinstance(state.get("profile"), dict) or \
            not isinstance(state.get("phases"), dict):
        raise ConfigError(f"--out {out}: {STATE_FILE} is not a speedrun record; choose another --out")
    return state


def first_difference(a: Any, b: Any, prefix: str = "") -> str | None:
    """The dotted key where two nested settings first differ, None when they are equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            where = first_difference(a.get(key), b.get(key), f"{prefix}{key}.")
            if where is not None:
                return where
        return None
    return None if a == b else prefix.rstrip(".")


def open_state(out: Path, profile: dict[str, Any]) -> dict[str, Any]:
    """OUT's record for `profile`: a new one for a new or empty folder, the saved one when OUT holds a
    speedrun of the same settings (continued). Anything else is refused with one line, before anything is
    written."""
    check_out_folder(out)
    state = read_state(out) if out.is_dir() else None
    if state is None:
        names = sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) if out.is_dir() else []
        if names:
            raise ConfigError(f"--out {out} holds other files ({', '.join(names[:3])}"
                              f"{', ...' if len(names) > 3 else ''}), not a speedrun; choose a new or empty "
                              "folder")
        state = {"profile": profile, "phases": {}}
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(state, out / STATE_FILE)
        return state
    key = first_difference(state["profile"], profile)
    if key is not None:
        before, now = lookup(state["profile"], key), lookup(profile, key)
        raise ConfigError(f"--out {out} holds another speedrun ({key}={before!r}, not {now!r}); rerun "
                          "it with the same profile and overrides to continue it, or choose another --out")
    return state


def lookup(settings: dict[str, Any], key: str) -> Any:
    node: Any = settings
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def record_phase(out: Path, state: dict[str, Any], phase: str, figures: dict[str, Any]) -> None:
    """Mark `phase` complete with its figures (after all its output is written)."""
    state["phases"][phase] = figures
    atomic_write_json(state, out / STATE_FILE)


__all__ = ["PHASES", "STATE_FILE", "first_difference", "open_state", "read_state", "record_phase"]
