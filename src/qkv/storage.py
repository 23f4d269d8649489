"""Files on disk, at the bottom of the library: the checkpoint error, atomic writes, the model-folder format
and the one check "does this state dict fit this model".

Models save themselves through `save_model` (QKVModel.save_pretrained), the checkpoint loader, the training
checkpoints and the Hugging Face loaders all check state dicts with `check_state_fits`, so the rules (tied
weights may be absent, wrapper prefixes are not part of a name, every shape must match) live in one place.
Nothing here knows a model family: it imports only qkv.config and qkv.nn.

Atomicity: every file is written to a temporary sibling, flushed to disk and renamed over the target in
one os.replace, so a crash leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from qkv.config import to_dict
from qkv.nn.params import tied_names

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile, DDP / DataParallel


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or belongs to another architecture."""


# -- atomic writes --------------------------------------------------------------------------------------
def umask_mode(kind: str) -> int:
    """The mode open() / mkdir() would give a new file ("file", 0o666) or folder ("dir", 0o777) under the
    process umask. tempfile's mkstemp / mkdtemp create theirs owner-only (0o600 / 0o700), which a rename
    keeps: a checkpoint another account serves or a team shares would be unreadable."""
    return (0o666 if kind == "file" else 0o777) & ~process_umask()


def process_umask() -> int:
    """The umask, read without changing it where the OS shows it (Linux: /proc/self/status): setting it to
    read it back would give a file another thread creates in that instant the modes of umask 0."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Run write(tmp) on a temporary sibling of `path` (a file name ending in .tmp), fsync it, rename it
    over `path`: the one atomic writer every other helper (and any file format) goes through."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, umask_mode("file"))
        with open(tmp, "rb") as f:  # on disk before the rename, so a crash cannot leave an empty file
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:  # an interrupted write leaves no temporary file behind
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(text: str, path: Path) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)


def atomic_write_json(obj: Any, path: Path) -> None:
    atomic_write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", path)


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: Path,
                            metadata: dict[str, str] | None = None) -> None:
    # safetensors stores row-major bytes: a channels_last convolution weight is written in its logical order
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


# Shard indexes a folder may hold from an earlier save (Hugging Face's names): a save of one model.safetensors
# replaces them, see remove_replaced_shards
SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def remove_replaced_shards(folder: Path, written: str = WEIGHTS_NAME) -> list[str]:
    """Remove the sharded weights of an earlier save from `folder`, once `written` (the one weights file of
    the new save) is complete in it: each SHARD_INDEXES file and the shard files its weight_map names. Left
    beside the new file they are a second, stale set of weights: transformers and qkv read model.safetensors
    first, but a tool that globs model*.safetensors or follows the index reads the old model, and they take
    the disk of a whole model. transformers' own save_pretrained removes its earlier shards the same way.

    Only the index files and what they name are touched, and of that only a plain file name of this folder
    ending in .safetensors or .bin (never a path elsewhere, never `written`): nothing else in the folder goes
    (a pytorch_model.bin beside it stays). An index that is not JSON names nothing, and only it goes. Returns
    the names removed."""
    removed: list[str] = []
    for index_name in SHARD_INDEXES:
        index = folder / index_name
        if not index.is_file():
            continue
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (ValueError, UnicodeDecodeError, AttributeError):
            weight_map = None
        names = set(weight_map.values()) if isinstance(weight_map, dict) else set()
        for name in sorted(n for n in names if isinstance(n, str)):
            shard = folder / name
            plain = Path(name).name == name and name not in (".", "..")
            if plain and name != written and name.endswith((".safetensors", ".bin")) and \
                    (shard.is_file() or shard.is_symlink()):
                shard.unlink()  # a symlink (the hub cache's snapshots/) goes, not the blob it points to
                removed.append(name)
        index.unlink()
        removed.append(index_name)
    return removed


# -- state dicts ----------------------------------------------------------------------------------------
def unwrap(model: nn.Module) -> nn.Module:
    """Strip DDP/FSDP `module` and torch.compile `_orig_mod` wrappers (nanoGPT #325, #351)."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        else:
            return model


def clean_key(name: str) -> str:
    """A state-dict name without wrapper prefixes, in any nesting order (module._orig_mod.x, ...)."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    return name.replace("._orig_mod.", ".").replace("._checkpoint_wrapped_module.", ".")


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop wrapper prefixes from keys and de-alias tied tensors (safetensors forbids shared storage)."""
    out, seen = {}, {}
    for k, v in state.items():
        k = clean_key(k)
        ptr = (v.data_ptr(), v.shape, v.stride()) if v.numel() else None
        if ptr is not None and ptr in seen:
            continue  # a tied weight: stored once, re-tied by the model's constructor on load
        if ptr is not None:
            seen[ptr] = k
        out[k] = v.detach().contiguous().cpu()
    return out


def model_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """State-dict names (without wrapper prefixes) -> global shapes. state_dict() gathers nothing: under
    FSDP2 its values are sharded DTensors whose .shape is the full shape."""
    return {clean_key(name): tuple(t.shape) for name, t in model.state_dict().items()}


def renamed_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with the model's renamed keys applied (`renamed_keys` on the model class: old -> new name),
    so checkpoints written before a module moved still load."""
    renames: Mapping[str, str] = getattr(unwrap(model), "renamed_keys", {}) or {}
    return {renames.get(k, k): v for k, v in state.items()}


def check_state_fits(model: nn.Module, state: Mapping[str, Any], source: str,
                     name: Callable[[str], str] = str) -> None:
    """Does `state` (our key -> tensor, or -> shape) fit `model`? Every key of the model must be there (a
    tied duplicate may be absent), no other key may be, and every shape must match; otherwise one
    CheckpointError naming what differs. `name(key)` says how to call a key in the message (the Hugging Face
    loaders name the file's keys). The one such check of the library: model folders, training checkpoints
    and the Hugging Face loaders all call it."""
    own = model_shapes(model)
    tied = tied_names(unwrap(model))
    missing = [k for k in own if k not in state and k not in tied]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        def show(keys: list[str]) -> str:
            return f"{[name(k) for k in keys[:5]]}{'...' if len(keys) > 5 else ''}"

        raise CheckpointError(f"{source} does not fit this {type(unwrap(model)).__name__}: missing "
                              f"{show(missing)}, unexpected {show(unexpected)}")
    for k, v in state.items():
        shape = tuple(v) if isinstance(v, (tuple, list, torch.Size)) else tuple(v.shape)
        if own[k] != shape:
            raise CheckpointError(f"{source}: {name(k)} has shape {shape}, model expects {own[k]}")


def load_state_into(model: nn.Module, state: Mapping[str, torch.Tensor], source: str = "checkpoint") -> None:
    """check_state_fits, then copy `state` into `model` (renamed keys applied; tied weights may be absent)."""
    state = renamed_state(model, state)
    check_state_fits(model, state, source)
    model.load_state_dict(state, strict=False)


# -- model folders --------------------------------------------------------------------------------------
SAVED_CONFIG = "qkv_config"  # the safetensors metadata key: the config (JSON) the weights were saved with
# model fields that change how a model trains or computes, not the function its weights compute: a resumed run
# may change them (train/checkpoint.py), and an edit of config.json may
MAY_DIFFER = frozenset({"dropout", "attn_dropout", "init_std", "embed_init_std", "attention",
                        "context_length"})


def config_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (saved, now)} for the fields outside MAY_DIFFER whose values differ (compared as JSON
    values)."""
    now = json.loads(json.dumps(now))
    return {k: (saved[k], now[k]) for k in saved if k in now and k not in MAY_DIFFER and saved[k] != now[k]}


def describe_changes(diff: Mapping[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items())


def save_model(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write `config.json` {"qkv_family", "config"} + `model.safetensors` into folder `path`, atomically:
    weights first, config last, so a folder with a config always has complete weights beside it. Each file is
    replaced atomically, but not the pair: a kill between the two renames over an older save leaves the new
    weights beside the old config, so the weights carry their config (SAVED_CONFIG) and `check_saved_config`
    refuses such a pair when it is loaded."""
    model = unwrap(model)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = clean_state_dict(model.state_dict())
    config = to_dict(model.config)
    atomic_save_safetensors(state, folder / WEIGHTS_NAME,
                            metadata={"qkv_family": model.family,
                                      SAVED_CONFIG: json.dumps(config, sort_keys=True)})
    atomic_write_json({"qkv_family": model.family, "config": config}, folder / CONFIG_NAME)
    remove_replaced_shards(folder)  # the new weights are complete: an earlier sharded save's files are stale
    return folder


def read_weights(weights: Path, device: str = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors file's tensors and its metadata, from one opening of the file."""
    try:
        with safe_open(str(weights), "pt", device=device) as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except Exception as e:  # safetensors raises its own error type for a truncated or corrupt file
        raise CheckpointError(f"{weights}: cannot read the weights ({e})") from None


def check_saved_config(weights: Path, metadata: Mapping[str, str], config: Mapping[str, Any]) -> None:
    """CheckpointError when `weights` were saved for a model that computes another function than `config`
    describes (their SAVED_CONFIG `metadata`; fields in MAY_DIFFER may differ: an edited dropout is fine).
    Files written before the metadata existed, and training checkpoints, which are replaced as one folder,
    pass."""
    saved = metadata.get(SAVED_CONFIG)
    try:
        saved = json.loads(saved) if saved is not None else None
    except ValueError:
        saved = None
    diff = config_changes(saved, config) if isinstance(saved, dict) else {}
    if diff:
        fields = ", ".join(f"{k} {a} (weights) vs {b} ({CONFIG_NAME})" for k, (a, b) in diff.items())
        raise CheckpointError(f"{weights.parent}: {weights.name} was saved for another model than the "
                              f"{CONFIG_NAME} beside it describes: {fields} (a save interrupted between its "
                              f"two files, or an edited {CONFIG_NAME}); save the model again")


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object file a model folder may hold ({} when absent); CheckpointError when it is not one."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """A folder's config.json (or the file itself) as a dict, with a clear error if absent or not JSON."""
    folder = Path(path)
    if not folder.exists():
        raise CheckpointError(f"checkpoint not found: {folder}")
    cfg = folder / CONFIG_NAME if folder.is_dir() else folder
    if not cfg.is_file():
        raise CheckpointError(f"{folder} has no {CONFIG_NAME}; not a qkv or Hugging Face model folder")
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        hint = (f"; pass the model folder (with its {CONFIG_NAME}), not a file" if cfg.name != CONFIG_NAME
                else "")
        raise CheckpointError(f"{cfg}: not valid JSON ({e}){hint}") from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise CheckpointError(f"{cfg}: nested too deeply to be a model config") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{cfg}: expected a JSON object, got {type(data).__name__}")
    return data
