"""Training checkpoints: a model folder plus the training state, written atomically.

    out_dir/checkpoints/step_00000500/
        config.json          {"qkv_family", "config"}: `qkv.from_pretrained(folder)` rebuilds the model
        model.safetensors    full (unsharded) weights, no wrapper prefixes, tied weights stored once
        train_state.pt       step, optimizer (keyed by parameter name), AdamW moments, LR multiplier,
                             GradScaler, RNG states of every rank, counters; torch.load(weights_only=True)
    out_dir/checkpoints/best/   the same, for the best evaluation so far (+ eval.json)

Atomicity (a SIGKILL at any instant loses nothing complete):
  - a checkpoint is written into a hidden temporary folder and renamed into place in one os.replace; a
    process killed mid-save leaves only a hidden `.tmp` folder, which nothing reads;
  - replacing an existing folder (best/, or a step rewritten after a rollback) moves the old one aside to a
    hidden `.NAME.old-PID` name, renames the new one in, then deletes the old: a kill between the two
    renames leaves the old copy, which `clean_stale` puts back;
  - pruning renames a doomed step folder to a hidden `.NAME.del-PID` name first (one rename), then deletes
    it, so a half-deleted folder is never mistaken for a checkpoint nor left behind;
  - `clean_stale` (run at every start, before anything is written) removes the hidden leftovers, restores an
    old best/ whose replacement was cut off, and removes step folders missing a file (old half-deletions).
The last `keep_last` step folders are kept.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from qkv.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    check_state_fits,
    clean_state_dict,
    config_changes,
    describe_changes,
    umask_mode,
    unwrap,
)
from qkv.config import to_dict
from qkv.storage import atomic_save_safetensors, atomic_write_json

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
    os.chmod(tmp, umask_mode("dir"))
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
    """Move folder `src` to `dst`. An existing `dst` is moved aside first (`.NAME.old-PID`) and deleted only
    once the new one is in place; if a kill falls between the two renames, clean_stale restores it. Folder
    renames, hence os.replace here: qkv.storage's atomic writes replace one file, and a checkpoint is a folder
    of several files that must appear (and be superseded) all at once."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        _delete_dir(old)


def _delete_dir(path: Path) -> None:
    """Delete a folder so that a kill midway leaves no half-folder under its name: one rename to a hidden
    `.NAME.del-PID` name (atomic), then the slow recursive delete of that."""
    doomed = path if path.name.startswith(".") else path.with_name(f".{path.name}.del-{os.getpid()}")
    if doomed != path:
        os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _complete(folder: Path) -> bool:
    return (folder / STATE_NAME).is_file() and (folder / WEIGHTS_NAME).is_file()


def clean_stale(root: Path) -> list[str]:
    """Repair what a killed process left under `root` (call before writing anything); returns what it did.

    Restores `best` from `.best.old-*` when a kill fell between the two renames of its replacement, then
    removes hidden leftovers (`.tmp` folders of cut-off saves, `.old-`/`.del-` folders of cut-off deletes)
    and step folders missing a file (a delete cut off by an older version that deleted in place)."""
    done: list[str] = []
    if not root.is_dir():
        return done
    for p in sorted(root.iterdir()):
        m = re.match(r"^\.(.+)\.old-\d+$", p.name)
        if m and p.is_dir() and not (root / m.group(1)).exists() and _complete(p):
            os.replace(p, root / m.group(1))
            done.append(f"restored {m.group(1)} from {p.name}")
    for p in sorted(root.iterdir()):
        hidden = p.name.startswith(".") and (
            p.name.endswith(".tmp") or ".old-" in p.name or ".del-" in p.name
        )
        broken = _STEP_RE.match(p.name) and p.is_dir() and not _complete(p)
        if hidden or broken:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            done.append(f"removed {p.name}")
    return done


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` step folders (0 keeps all); the best folder is separate."""
    found = list_checkpoints(root)
    if keep_last <= 0 or len(found) <= keep_last:
        return []
    doomed = [p for _, p in found[:-keep_last]]
    for p in doomed:
        _delete_dir(p)
    return doomed


def state_is_finite(model_state: dict[str, torch.Tensor], optim_state: dict[str, Any] | None = None) -> bool:
    """True when every floating tensor of the weights and the optimizer moments is finite."""
    tensors = list(model_state.values())
    for st in ((optim_state or {}).get("state") or {}).values():
        tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def check_fits(model: nn.Module, folder: Path) -> None:
    """CheckpointError unless the weights in `folder` fit `model` key for key and shape for shape. Reads
    only the safetensors header (names and shapes), so it is cheap enough to run before writing anything."""
    weights = folder / WEIGHTS_NAME
    if not _complete(folder):
        raise CheckpointError(f"{folder} is not a complete training checkpoint (needs {WEIGHTS_NAME} and "
                              f"{STATE_NAME})")
    try:
        with safe_open(str(weights), "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:
        raise CheckpointError(f"{weights}: cannot read checkpoint ({type(e).__name__}: {e})") from None
    check_state_fits(model, {k: torch.empty(v, device="meta") for k, v in shapes.items()}, str(folder))


def check_same_architecture(model: nn.Module, folder: Path) -> None:
    """CheckpointError when `model` differs from the checkpoint's config.json in a field that changes the
    function its weights compute (ffn=relu on a GELU run, scaled=false): the shapes still fit, so nothing
    else would notice, and a resumed run would go on training other weights than it says."""
    path = Path(folder) / CONFIG_NAME
    try:
        saved = json.loads(path.read_text(encoding="utf-8")).get("config") if path.is_file() else None
    except (ValueError, AttributeError):  # not JSON, or not an object: nothing to compare with
        saved = None
    config = getattr(unwrap(model), "config", None)
    if not isinstance(saved, dict) or config is None:
        return
    try:
        diff = config_changes(saved, to_dict(config))  # what a resume may change: storage.MAY_DIFFER
    except TypeError:  # not a dataclass config
        return
    if diff:
        raise CheckpointError("resume: the model differs from the run's checkpoint "
                              f"({describe_changes(diff)}) in {folder}; its weights were trained for the "
                              "saved one: resume without the change, or start a new run in another output "
                              "folder")


def read_checkpoint(folder: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(model state, train state) of a checkpoint folder; never unpickles code (weights_only=True)."""
    folder = Path(folder)
    weights, state = folder / WEIGHTS_NAME, folder / STATE_NAME
    if not weights.is_file() or not state.is_file():
        raise CheckpointError(f"{folder} is not a complete training checkpoint (needs {WEIGHTS_NAME} and "
                              f"{STATE_NAME})")
    try:
        model_state = load_file(str(weights))
    except Exception as e:  # a truncated or foreign file: one clear sentence instead of a deep trace
        raise CheckpointError(f"{folder}: cannot read checkpoint ({type(e).__name__}: {e})") from None
    return model_state, read_train_state(state)


def read_train_state(path: Path, *, mmap: bool = False) -> dict[str, Any]:
    """train_state.pt through torch.load(weights_only=True), any failure one line: torch's own text for a
    pickled object is several lines, with terminal colour codes, and suggests weights_only=False, which would
    run the file's code. mmap: map the tensors instead of reading them (a cheap check before a resume)."""
    try:
        train_state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", re.sub(r"\x1b\[[0-9;]*m", "", str(e)))
        called = f" ({found.group(1)})" if found else ""
        raise CheckpointError(
            f"{path}: refused: it holds pickled objects other than tensors{called}; "
            "loading them would run code from the file (qkv writes plain tensors and "
            "numbers)"
        ) from None
    except Exception as e:  # a truncated or foreign file
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        raise CheckpointError(
            f"{path.parent}: cannot read checkpoint ({type(e).__name__}: {first})"
        ) from None
    if not isinstance(train_state, dict) or "step" not in train_state:
        raise CheckpointError(f"{path} is not a qkv training state")
    return train_state


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))
