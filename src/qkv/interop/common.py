"""Shared machinery of the Hugging Face loaders: rename a folder's tensors through an explicit key map,
check every shape, and copy them into a qkv model.

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

Loading holds about one copy of the weights (benchmarks/load_memory.py measures it): `HFTensors`
(interop/files.py) reads a safetensors folder's names, shapes and dtypes from the file headers and each
tensor only when it is copied; every check above runs on those shapes before anything is allocated; the
model is built with its parameters on the meta device and its buffers real (`build_skeleton`,
interop/skeleton.py) and given storage in the dtype it will keep; then each parameter is filled from its
pieces, one piece at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

# HFTensors, build_skeleton and SkipInitOnMeta are imported from here by the loaders: one import line each
from qkv.interop.files import HFTensors, meta_of
from qkv.interop.skeleton import SkipInitOnMeta, build_skeleton, materialise
from qkv.storage import (
    CheckpointError,
    atomic_save_safetensors,
    atomic_write_json,
    check_state_fits,
    remove_replaced_shards,
)

Transform = Callable[[Tensor], Tensor]


# -- config.json's sizes against the file, before anything is built ------------------------------------
# (config.json field, its value, a file key, the dim of that key's shape the field sizes); dim None: the key
# is a template with "{}" for the layer index, and the value is the number of layers
SizeCheck = tuple[str, Any, str, int | None]


def check_sizes(state: Mapping[str, Tensor], source: str, checks: Iterable[SizeCheck]) -> None:
    """Every size config.json gives (layers, width, vocabulary, positions, ...) against the file's tensor
    shapes, read from its headers: a wrong field is named before a key map is expanded or a model built from
    it (a config saying n_layer = 10**9 or vocab_size = 10**12 would otherwise allocate until memory runs
    out). A key the file lacks is not checked here: the key map reports it as missing."""
    config = Path(source).parent / "config.json"
    for field, value, key, dim in checks:
        if not isinstance(value, int) or isinstance(value, bool):
            continue  # not a size at all: building the config says so (load_hf's "unusable value")
        if dim is None:
            layer = re.compile("^" + re.escape(key).replace(re.escape("{}"), r"(\d+)") + "$")
            found = {m.group(1) for k in state if (m := layer.match(k))}
            if value != len(found):
                raise CheckpointError(
                    f"{config}: {field} is {value!r}, but {source} holds {len(found)} layers "
                    f"(keys {key.replace('{}', 'N')!r})"
                )
            continue
        if key not in state:
            continue
        shape = tuple(meta_of(state, key).shape)
        if dim >= len(shape) or value != shape[dim]:
            raise CheckpointError(f"{config}: {field} is {value!r}, but {source} has {key} of shape {shape}"
                                  + (f" ({field} would be {shape[dim]})" if dim < len(shape) else ""))


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


def _check_names(hf_state: Mapping[str, Tensor], mapping: Mapping[str, str], ignore: Iterable[str],
                 source: str) -> None:
    """Every key the map needs is in the file, and every key of the file is mapped or ignored."""
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
            f"{source}: unexpected key {unexpected[0]!r}"
            + (f" (and {len(unexpected) - 1} more: {unexpected[1:4]})" if len(unexpected) > 1 else "")
            + "; this architecture variant is not supported by the loader"
        )


def _transform(t: Tensor, hf: str, compiled: list[tuple[re.Pattern[str], Transform]]) -> Tensor:
    for pat, fn in compiled:
        if pat.match(hf):
            t = fn(t)
    return t


def _groups(mapping: Mapping[str, str]) -> dict[str, list[str]]:
    """our key -> the HF keys that build it, in the map's order (the order they are concatenated in)."""
    groups: dict[str, list[str]] = {}
    for hf, ours in mapping.items():
        groups.setdefault(ours, []).append(hf)
    return groups


def _check_concatenable(ours: str, hfs: list[str], shapes: list[tuple[int, ...]], source: str) -> None:
    if len(shapes) > 1 and len({s[1:] for s in shapes}) != 1:
        raise CheckpointError(
            f"{source}: cannot concatenate {hfs} into {ours!r}: shapes {shapes} differ beyond dim 0"
        )


def _half_dtype(dtypes: set[torch.dtype]) -> torch.dtype | None:
    """The file's dtype when its floating tensors are all bf16 or all fp16 (the model keeps it), else None."""
    if len(dtypes) == 1 and (half := next(iter(dtypes))) in (torch.bfloat16, torch.float16):
        return half
    return None


def load_hf_weights(
    model: nn.Module,
    hf_state: Mapping[str, Tensor],
    mapping: Mapping[str, str],
    *,
    transforms: Mapping[str, Transform] | None = None,
    ignore: Iterable[str] = (),
    source: str = "checkpoint",
    tied: Mapping[str, tuple[str, str]] | None = None,
) -> nn.Module:
    """Fill `model` (a `build_skeleton`, or a built model) from `hf_state` (an HFTensors, or any mapping)
    through `mapping`, holding one HF tensor at a time beside the model.

    Everything is checked before a byte is read or a parameter allocated, from the tensors' shapes and dtypes
    (the transforms run on meta tensors to learn theirs): the names (missing / unexpected), that the pieces of
    a fused parameter concatenate, and check_state_fits (every parameter filled, every shape equal, errors
    naming the file's keys). The dtype rule, as transformers loads: a file whose floating tensors are all bf16
    (or all fp16) keeps that dtype, else the model's. Then each parameter gets its storage and is filled piece
    by piece (a fused q/k/v is never concatenated: each piece is copied into its rows).
    tied: {file key: (the file key it must equal, the error if it does not)}, for copies of tied tensors that
    a file may store; checked after the copy, against the parameter the reference filled, so nothing is read
    twice. An HFTensors is consumed: the tensors it holds in memory (a pickle's) are released as they are
    copied."""
    compiled = [(_pattern(t), fn) for t, fn in (transforms or {}).items()]
    _check_names(hf_state, mapping, ignore, source)
    groups = _groups(mapping)
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: set[torch.dtype] = set()
    for ours, hfs in groups.items():
        metas = [_transform(meta_of(hf_state, hf), hf, compiled) for hf in hfs]
        _check_concatenable(ours, hfs, [tuple(t.shape) for t in metas], source)
        shapes[ours] = tuple(metas[0].shape) if len(metas) == 1 else \
            (sum(t.shape[0] for t in metas), *metas[0].shape[1:])
        dtypes |= {t.dtype for t in metas if t.is_floating_point()}
    check_state_fits(model, shapes, source, name=lambda k: ", ".join(groups.get(k, [k])))
    materialise(model, _half_dtype(dtypes))
    own = model.state_dict()
    needed = {ref for ref, _ in (tied or {}).values()}  # compared after the fill
    with torch.no_grad():
        for ours, hfs in groups.items():
            target, start = own[ours], 0
            for hf in hfs:  # one piece alive at a time: read, transform, copy into its rows, drop
                t = _transform(hf_state[hf], hf, compiled)
                (target if len(hfs) == 1 else target.narrow(0, start, t.shape[0])).copy_(t)
                start += t.shape[0] if t.dim() else 0
                del t
                if isinstance(hf_state, HFTensors) and hf not in needed:
                    hf_state.release(hf)  # a pickle's tensor: freed as soon as it is copied
    for k, (ref, message) in (tied or {}).items():
        if k not in hf_state or ref not in hf_state:
            continue
        got = hf_state[k]
        if ref in mapping and groups[mapping[ref]] == [ref] and not any(p.match(ref) for p, _ in compiled):
            want = own[mapping[ref]]  # the parameter ref was copied into, in the model's dtype
            got = got.to(want.dtype)
        else:
            want = hf_state[ref]
        require(got.shape == want.shape and torch.equal(got, want), message)
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


def unlike(config: Any, **holds: Any) -> list[str]:
    """`name=value` of each field of `config` that a format cannot hold: it holds the value given, or any of
    a tuple's. What a refusal names, so that its message says what does not fit."""
    out = []
    for name, ok in holds.items():
        value = getattr(config, name)
        if not (value in ok if isinstance(ok, tuple) else value == ok):
            out.append(f"{name}={value!r}")
    return out


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


__all__ = ["HFTensors", "SkipInitOnMeta", "Transform", "build_skeleton", "check_sizes", "expand",
           "export_state", "load_hf_weights", "materialise", "meta_of", "require", "write_hf_folder"]
