"""Training checkpoints: a model folder plus the training state, written atomically.

    out_dir/checkpoints/step_00000500/
        config.json          {"qkv_family", "config"}: `qkv.from_pretrained(folder)` rebuilds the model
        model.safetensors    full (unsharded) weights, no wrapper prefixes, tied weights stored once
        train_state.pt       step, optimizer (keyed by parameter name), AdamW moments, LR multiplier,
                             GradScaler, RNG states of every rank, counters; torch.load(weights_only=True)
    out_dir/checkpoints/best/   the same, for the best evaluation so far (+ eval.json)

Atomicity: a checkpoint is written into a hidden temporary folder and renamed into place in one
os.replace; a process killed mid-save leaves only a `.tmp` folder (ignored, removed at the next save) and
the previous checkpoints intact. The last `keep_last` step folders are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from qkv.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    atomic_save_safetensors,
    atomic_write_json,
    check_state_fits,
    clean_state_dict,
)
from qkv.config import to_dict

STATE_NAME = "train_state.pt"
BEST = "best"
_STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete step checkpoints under `root`, oldest first (a folder counts once its state file exists)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / STATE_NAME).is_file() and (p / WEIGHTS_NAME).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def model_meta(model: nn.Module) -> dict[str, Any]:
    family = getattr(model, "family", None)
    config = getattr(model, "config", None)
    try:
        cfg = to_dict(config) if config is not None else None
    except TypeError:  # not a dataclass: the folder still holds weights, but cannot rebuild the model
        cfg = None
    return {"qkv_family": family or None, "config": cfg}


def write_checkpoint(folder: Path, model_state: dict[str, torch.Tensor], meta: dict[str, Any],
                     train_state: dict[str, Any], extra_json: dict[str, Any] | None = None) -> Path:
    """Write one checkpoint folder atomically (temporary sibling folder + rename)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp"))
    try:
        atomic_save_safetensors(clean_state_dict(model_state), tmp / WEIGHTS_NAME,
                                metadata={"qkv_family": str(meta.get("qkv_family"))})
        atomic_write_json(meta, tmp / CONFIG_NAME)
        if extra_json:
            for name, obj in extra_json.items():
                atomic_write_json(obj, tmp / name)
        _torch_save(train_state, tmp / STATE_NAME)
        _replace_dir(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _replace_dir(src: Path, dst: Path) -> None:
    """Move folder `src` to `dst`; an existing `dst` is moved aside first and deleted only afterwards."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def clean_stale(root: Path) -> None:
    """Remove temporary folders left by a process killed while saving."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".") and (p.name.endswith(".tmp") or ".old-" in p.name):
                shutil.rmtree(p, ignore_errors=True)


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` step folders (0 keeps all); the best folder is separate."""
    found = list_checkpoints(root)
    if keep_last <= 0 or len(found) <= keep_last:
        return []
    doomed = [p for _, p in found[:-keep_last]]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def read_checkpoint(folder: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(model state, train state) of a checkpoint folder; never unpickles code (weights_only=True)."""
    folder = Path(folder)
    weights, state = folder / WEIGHTS_NAME, folder / STATE_NAME
    if not weights.is_file() or not state.is_file():
        raise CheckpointError(f"{folder} is not a complete training checkpoint (needs {WEIGHTS_NAME} and {STATE_NAME})")
    try:
        model_state = load_file(str(weights))
        train_state = torch.load(state, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: one clear sentence instead of a deep trace
        raise CheckpointError(f"{folder}: cannot read checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(train_state, dict) or "step" not in train_state:
        raise CheckpointError(f"{state} is not a qkv training state")
    return model_state, train_state


def check_model_state(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Every key and shape must match the (unwrapped, possibly FSDP-sharded) model; tied duplicates may be
    absent. The library's one fit check (qkv.storage.check_state_fits)."""
    check_state_fits(model, state, source)


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(obj, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))
