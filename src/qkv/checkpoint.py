"""Model folders: `config.json` (family + config) and `model.safetensors`. Atomic writes, no pickle.

A folder written here rebuilds its model from itself alone: `qkv.from_pretrained(folder)`.
Hugging Face-format folders are read by qkv.interop instead (dispatch in `load_model`).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from qkv.config import ConfigError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or belongs to another architecture."""


def unwrap(model: nn.Module) -> nn.Module:
    """Strip DDP/FSDP `module` and torch.compile `_orig_mod` wrappers (nanoGPT #325, #351)."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        else:
            return model


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop wrapper prefixes from keys and de-alias tied tensors (safetensors forbids shared storage)."""
    out, seen = {}, {}
    for k, v in state.items():
        stripped = True
        while stripped:  # any nesting order: module._orig_mod.x, _orig_mod.module.x, ...
            stripped = False
            for prefix in ("_orig_mod.", "module."):
                if k.startswith(prefix):
                    k, stripped = k[len(prefix):], True
        k = k.replace("._orig_mod.", ".").replace("._checkpoint_wrapped_module.", ".")
        ptr = (v.data_ptr(), v.shape, v.stride()) if v.numel() else None
        if ptr is not None and ptr in seen:
            continue  # a tied weight: stored once, re-tied by the model's constructor on load
        if ptr is not None:
            seen[ptr] = k
        out[k] = v.detach().contiguous().cpu()
    return out


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb") as f:  # on disk before the rename, so a crash cannot leave an empty file
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_json(obj: Any, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:  # an interrupted write leaves no temporary file behind
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_model(model: nn.Module, path: str | os.PathLike) -> Path:
    from qkv.config import to_dict

    model = unwrap(model)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = clean_state_dict(model.state_dict())
    # weights first, config last: a folder with a config always has complete weights beside it
    atomic_save_safetensors(state, folder / WEIGHTS_NAME, metadata={"qkv_family": model.family})
    atomic_write_json({"qkv_family": model.family, "config": to_dict(model.config)}, folder / CONFIG_NAME)
    return folder


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    folder = Path(path)
    if not folder.exists():
        raise CheckpointError(f"checkpoint not found: {folder}")
    cfg = folder / CONFIG_NAME if folder.is_dir() else folder
    if not cfg.is_file():
        raise CheckpointError(f"{folder} has no {CONFIG_NAME}; not a qkv or Hugging Face model folder")
    try:
        return json.loads(cfg.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg}: not valid JSON ({e})") from None


def load_state_into(model: nn.Module, state: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Copy `state` into `model`, checking every key and shape; tied weights may be absent."""
    own = model.state_dict()
    tied = _tied_names(model)
    missing = [k for k in own if k not in state and k not in tied]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not fit this {type(model).__name__}: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise CheckpointError(f"{source}: {k} has shape {tuple(v.shape)}, model expects {tuple(own[k].shape)}")
    model.load_state_dict(state, strict=False)


def _tied_names(model: nn.Module) -> set[str]:
    """Names under which an already-listed parameter appears again (weight tying)."""
    seen, tied = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.add(id(p))
    return tied


def load_model(path: str | os.PathLike, *, map_location: str | torch.device = "cpu") -> nn.Module:
    """Rebuild a model from a qkv folder, or from a Hugging Face folder (by config.json's model_type)."""
    from qkv.models.registry import family

    folder = Path(path)
    meta = read_config(folder)
    if folder.is_file():  # the path of the folder's config.json itself
        folder = folder.parent
    if "qkv_family" not in meta:
        if "model_type" in meta:
            from qkv.interop import load_hf

            return load_hf(folder)
        raise CheckpointError(f"{folder}/config.json names neither a qkv family nor a Hugging Face model_type")
    if not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"{folder}/{CONFIG_NAME} has no 'config' mapping beside 'qkv_family'")
    try:
        from qkv.config import from_dict

        fam = family(meta["qkv_family"])
        config = from_dict(fam.config_class, meta["config"])
    except ConfigError as e:
        raise CheckpointError(f"{folder}: {e}") from None
    model = fam.model_class(config)
    weights = folder / WEIGHTS_NAME
    if not weights.is_file():
        raise CheckpointError(f"{folder} has no {WEIGHTS_NAME}")
    try:
        state = load_file(str(weights), device=str(map_location))
    except Exception as e:  # safetensors raises its own error type for a truncated or corrupt file
        raise CheckpointError(f"{weights}: cannot read the weights ({e})") from None
    load_state_into(model, state, str(weights))
    return model
