"""Shared machinery of the Hugging Face loaders: read a folder, rename its tensors through an explicit
key map, check every shape, and copy them into a qkv model.

A family module (gpt2.py, bert.py, vit.py, ...) supplies three things:

  config  a function HF config.json dict -> our config dataclass (rejecting what we cannot represent)
  map     {hf_key: our_key}, with "{}" standing for the layer index (expanded by `expand`). Several HF keys
          may map to the same key of ours: they are concatenated along dim 0 in the map's order, which is
          how a fused Linear stacks its outputs (BERT's query/key/value -> our qkv_proj).
  transforms  optional {hf_key_pattern: fn(tensor) -> tensor}, applied to a HF tensor before it is
          placed/concatenated (GPT-2's Conv1D stores weights as (in, out): transpose).

`load_hf_weights` then checks, in this order, and raises CheckpointError naming the key:
  a HF key the map needs is absent from the file          -> "missing"
  a key in the file that the map does not use             -> "unexpected" (unless listed in `ignore`)
  a converted tensor whose shape differs from the model's -> "shape"
  a parameter of ours that nothing in the map fills       -> a map bug, also reported

Weights are read from model.safetensors (or its sharded index), or from pytorch_model.bin through
torch.load(weights_only=True): loading never unpickles arbitrary code.
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qkv.storage import (
    CheckpointError,
    atomic_save_safetensors,
    atomic_write_json,
    check_state_fits,
    read_config,
    remove_replaced_shards,
)

Transform = Callable[[Tensor], Tensor]

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"


# -- reading a folder ---------------------------------------------------------------------------------
def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """config.json as a dict (a clear error if it is absent or not JSON)."""
    return read_config(folder)


def _load_torch_bin(path: Path) -> dict[str, Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # never unpickles code
    except Exception as e:  # UnpicklingError for disallowed globals, RuntimeError for a corrupt file
        # torch's text is many lines and suggests weights_only=False, which would run the file's code: keep the
        # one line that says what was found
        # ("Unsupported global: GLOBAL builtins.print", "unsupported GLOBAL posix.system whose module posix is
        # blocked": torch words it by how dangerous the global is)
        found = re.search(r"GLOBAL (\S+)", str(e))
        if found is None and not isinstance(e, pickle.UnpicklingError):
            first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            raise CheckpointError(f"{path}: cannot be read as a plain tensor state dict ({first})") from None
        called = f" (it would call {found.group(1)})" if found else ""
        raise CheckpointError(f"{path}: refused: it holds pickled objects other than tensors{called}; loading them "
                              "would run code from the file. Convert it to safetensors.") from None
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a mapping of names to tensors")
    return dict(state)


def _load_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as e:
        raise CheckpointError(f"{path}: cannot be read as safetensors ({e})") from None


def shard_files(index: Path) -> list[Path]:
    """The shard files a `*.index.json` names, each checked to be a file of the index's folder as written (no
    absolute path, no `..`); a clear error for an index of any other shape. Symlinks are followed: the Hugging
    Face hub cache keeps every file of `snapshots/<revision>/` as a link into `../../blobs/`."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a valid shard index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, Mapping) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
    files = []
    for shard in sorted(set(weight_map.values())):
        if Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise CheckpointError(f"{index} lists shard {shard!r}, which is outside the model folder")
        if not (index.parent / shard).is_file():
            raise CheckpointError(f"{index} lists shard {shard!r}, which is not in the folder")
        files.append(index.parent / shard)
    return files


def _load_sharded(index: Path, reader: Callable[[Path], dict[str, Tensor]]) -> dict[str, Tensor]:
    state: dict[str, Tensor] = {}
    for shard in shard_files(index):
        state.update(reader(shard))
    return state


def read_hf_state(folder: str | Path) -> tuple[dict[str, Tensor], str]:
    """All tensors of a HF folder and the file they came from. Prefers safetensors over pickles."""
    folder = Path(folder)
    candidates = [
        (SAFETENSORS, _load_safetensors),
        (SAFETENSORS_INDEX, lambda p: _load_sharded(p, _load_safetensors)),
        (TORCH_BIN, _load_torch_bin),
        (TORCH_BIN_INDEX, lambda p: _load_sharded(p, _load_torch_bin)),
    ]
    for name, reader in candidates:
        if (folder / name).is_file():
            return reader(folder / name), str(folder / name)
    raise CheckpointError(f"{folder} has no weights: expected one of {[n for n, _ in candidates]}")


# -- key maps -----------------------------------------------------------------------------------------
def expand(mapping: Mapping[str, str], n_layers: int) -> dict[str, str]:
    """Replace "{}" by 0 .. n_layers-1 in every entry that has it (HF and our key alike)."""
    out: dict[str, str] = {}
    for hf, ours in mapping.items():
        if "{}" in hf:
            for i in range(n_layers):
                out[hf.replace("{}", str(i))] = ours.replace("{}", str(i))
        else:
            out[hf] = ours
    return out


def _pattern(template: str) -> re.Pattern[str]:
    """A key template with "{}" for any layer index -> a full-match regex."""
    return re.compile("^" + re.escape(template).replace(re.escape("{}"), r"\d+") + "$")


def strip_prefix(state: dict[str, Tensor], prefixes: Iterable[str]) -> dict[str, Tensor]:
    """Drop the first of `prefixes` that a key starts with (HF task models wrap the base model as
    'transformer.' / 'bert.'; base-model checkpoints have no prefix). Head keys stay as they are."""
    prefixes = tuple(prefixes)
    out = {}
    for k, v in state.items():
        for p in prefixes:
            if k.startswith(p):
                k = k[len(p):]
                break
        out[k] = v
    return out


def convert_state(
    hf_state: Mapping[str, Tensor],
    mapping: Mapping[str, str],
    *,
    transforms: Mapping[str, Transform] | None = None,
    ignore: Iterable[str] = (),
    source: str = "checkpoint",
) -> tuple[dict[str, Tensor], dict[str, list[str]]]:
    """Rename (and transform / concatenate) HF tensors into our key space.

    mapping: concrete keys (already expanded). ignore: key templates ("{}" = any index) of tensors that
    may be in the file but carry nothing we need (HF's causal-mask buffers, position_ids, ...).
    Returns (our state dict, our_key -> the HF keys it was built from) for error messages."""
    compiled = [(_pattern(t), fn) for t, fn in (transforms or {}).items()]
    ignored = [_pattern(t) for t in ignore]
    missing = [hf for hf in mapping if hf not in hf_state]
    if missing:
        raise CheckpointError(
            f"{source}: missing key {missing[0]!r}" + (f" (and {len(missing) - 1} more: {missing[1:4]})"
                                                      if len(missing) > 1 else "")
        )
    unexpected = [k for k in hf_state if k not in mapping and not any(p.match(k) for p in ignored)]
    if unexpected:
        raise CheckpointError(
            f"{source}: unexpected key {unexpected[0]!r}" + (f" (and {len(unexpected) - 1} more: "
                                                            f"{unexpected[1:4]})" if len(unexpected) > 1 else "")
            + "; this architecture variant is not supported by the loader"
        )
    parts: dict[str, list[Tensor]] = {}
    sources: dict[str, list[str]] = {}
    for hf, ours in mapping.items():
        t = hf_state[hf]
        for pat, fn in compiled:
            if pat.match(hf):
                t = fn(t)
        parts.setdefault(ours, []).append(t)
        sources.setdefault(ours, []).append(hf)
    state = {}
    for ours, ts in parts.items():
        if len(ts) > 1 and len({tuple(t.shape[1:]) for t in ts}) != 1:
            raise CheckpointError(f"{source}: cannot concatenate {sources[ours]} into {ours!r}: "
                                  f"shapes {[tuple(t.shape) for t in ts]} differ beyond dim 0")
        state[ours] = ts[0] if len(ts) == 1 else torch.cat(ts, dim=0)
    return state, sources


def load_converted(model: nn.Module, state: Mapping[str, Tensor], sources: Mapping[str, list[str]],
                   source: str = "checkpoint") -> None:
    """Copy our-key tensors into `model` after the library's one fit check (every parameter filled, tied
    copies excepted; every shape equal), naming the file's keys in errors. A file whose floating tensors are all
    bf16 (or all fp16) keeps that dtype, as transformers loads it: the model is cast to it first, so the copies are
    exact and nothing is held twice in fp32. Files of other (or mixed) dtypes load into the model's dtype."""
    check_state_fits(model, state, source, name=lambda k: ", ".join(sources.get(k, [k])))
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(dtypes) == 1 and (half := next(iter(dtypes))) in (torch.bfloat16, torch.float16):
        model.to(dtype=half)
    own = model.state_dict()
    with torch.no_grad():
        for ours, t in state.items():
            own[ours].copy_(t)  # in place: keeps weight tying and the model's dtype/device


def load_hf_weights(
    model: nn.Module,
    hf_state: Mapping[str, Tensor],
    mapping: Mapping[str, str],
    *,
    transforms: Mapping[str, Transform] | None = None,
    ignore: Iterable[str] = (),
    source: str = "checkpoint",
) -> nn.Module:
    """convert_state + load_converted: the one call a family loader makes once it has built `model`."""
    state, sources = convert_state(hf_state, mapping, transforms=transforms, ignore=ignore, source=source)
    load_converted(model, state, sources, source)
    return model


def write_hf_folder(folder: str | Path, state: Mapping[str, Tensor], hf_config: Mapping[str, Any]) -> Path:
    """A Hugging Face model folder: `model.safetensors` (HF's "pt" format tag) and `config.json`, each
    written atomically; what every exporter in this package ends with. Exporting into a folder that holds a
    sharded model (its source folder, or an earlier sharded save) replaces it the way a single
    model.safetensors is replaced: once the new files are written, the old index and the shards it names
    are removed (qkv.storage.remove_replaced_shards), so the folder holds one set of weights."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(dict(state), folder / "model.safetensors", metadata={"format": "pt"})
    atomic_write_json(dict(hf_config), folder / "config.json")
    remove_replaced_shards(folder)
    return folder


def require(cond: bool, message: str) -> None:
    """A config we cannot represent faithfully is refused, never loaded approximately."""
    if not cond:
        raise CheckpointError(message)


# -- the other direction (qkv -> HF folder) -----------------------------------------------------------
def export_state(
    our_state: Mapping[str, Tensor],
    mapping: Mapping[str, str],
    *,
    transforms: Mapping[str, Transform] | None = None,
) -> dict[str, Tensor]:
    """Invert a concrete map: our tensors -> HF keys. A fused key of ours is split evenly over the HF keys
    that built it (in map order); `transforms` here are the inverse ones, keyed by HF key template."""
    compiled = [(_pattern(t), fn) for t, fn in (transforms or {}).items()]
    groups: dict[str, list[str]] = {}
    for hf, ours in mapping.items():
        groups.setdefault(ours, []).append(hf)
    out: dict[str, Tensor] = {}
    for ours, hfs in groups.items():
        if ours not in our_state:
            raise CheckpointError(f"cannot export: the model has no {ours!r}")
        t = our_state[ours].detach()
        pieces = [t] if len(hfs) == 1 else list(t.chunk(len(hfs), dim=0))
        for hf, piece in zip(hfs, pieces):
            for pat, fn in compiled:
                if pat.match(hf):
                    piece = fn(piece)
            out[hf] = piece.contiguous().clone()
    return out
