"""A qkv model folder's config.json against its weights, before the model is built.

config.json is input (a folder from the internet, or an edited one): a model built from `n_layers: 10**9` or
`vocab_size: 10**12` would allocate until memory runs out, or fail inside torch with a traceback. So, before
the real build: the fields that count modules (layers, experts) are bounded by the file; the model is then
built on the meta device (shapes, no storage) and its tensors compared with the safetensors header, naming the
config field a wrong shape comes from; and what no weight shows (a RoPE table as long as `context_length`) is
weighed against the machine's memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from qkv.config import memory_bytes
from qkv.interop.common import SkipInitOnMeta
from qkv.storage import CONFIG_NAME, CheckpointError, check_state_fits, clean_key, renamed_state

# config fields that set how many modules a constructor makes: building even on the meta device runs Python
# once per module, so these are bounded by the file first (every layer or expert has a tensor of its own, or a
# dimension of a stacked one)
COUNT_FIELDS = frozenset({"n_layers", "n_encoder_layers", "n_decoder_layers", "depths", "n_experts",
                          "n_shared_experts"})


def header_shapes(weights: Path) -> dict[str, tuple[int, ...]] | None:
    """name -> shape from a safetensors file's header (no tensor is read); None when it cannot be read
    (read_weights then says why)."""
    try:
        with safe_open(str(weights), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception:  # safetensors raises its own error type for a truncated or corrupt file
        return None


def int_fields(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, int]]:
    """(dotted name, value) of every integer in a config mapping, nested sections and list items included
    ("widths[2]")."""
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from int_fields(value, f"{name}.")
        elif isinstance(value, list):
            yield from ((f"{name}[{i}]", v) for i, v in enumerate(value) if _is_int(v))
        elif _is_int(value):
            yield name, value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_counts(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], where: str,
                  source: str) -> None:
    bound = max([len(shapes), *(d for s in shapes.values() for d in s)], default=0)

    def walk(section: Mapping[str, Any], prefix: str) -> None:
        for key, value in section.items():
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{key}.")
            elif key in COUNT_FIELDS:
                count = sum(v for v in value if _is_int(v)) if isinstance(value, list) else value
                if _is_int(count) and count > bound:
                    raise CheckpointError(f"{where}: {prefix}{key} is {value!r}, but {source} holds "
                                          f"{len(shapes)} tensors (largest dimension {bound}): too few for "
                                          "that many")

    walk(config, "")


def _meta_model(build: Any, config: Mapping[str, Any], where: str) -> nn.Module | None:
    """build() on the meta device, every tensor a shape without storage; None for a constructor that computes
    from a tensor's values (Whisper's mel filters call .item()): that model is built for real, unchecked."""
    try:
        with torch.device("meta"), SkipInitOnMeta():
            return build()
    except (RuntimeError, NotImplementedError) as e:
        if "overflow" not in str(e):
            return None
        largest = max(int_fields(config), key=lambda nv: nv[1], default=None)  # a tensor of over 2**63 bytes
        why = f" ({largest[0]} is {largest[1]})" if largest else ""
        raise CheckpointError(f"{where}: describes tensors too large for any machine{why}") from None


def _field_for(config: Mapping[str, Any], value: int) -> str | None:
    """The config field(s) holding `value` ("d_ff / d_model" when both do), None when none does."""
    return " / ".join(name for name, v in int_fields(config) if v == value) or None


def _check_shapes(model: nn.Module, shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any],
                  where: str, source: str) -> None:
    """A tensor the file and the config both have, in other shapes: one error naming the config field that
    sets the differing dimension (when one holds that value); then check_state_fits for missing and unexpected
    keys, as the real load would say them."""
    own = {clean_key(k): tuple(t.shape) for k, t in model.state_dict().items()}
    state = renamed_state(model, shapes)
    for key, shape in state.items():
        want = own.get(key)
        if want is None or want == shape:
            continue
        dim = next((i for i, (a, b) in enumerate(zip(want, shape)) if a != b), None)
        field = _field_for(config, want[dim]) if dim is not None else None
        if field is not None:
            verb = "are" if "/" in field else "is"
            raise CheckpointError(f"{where}: {field} {verb} {want[dim]}, but {source} has {key} of shape "
                                  f"{shape} ({field} would be {shape[dim]})")
        raise CheckpointError(f"{source}: {key} has shape {shape}, model expects {want}")
    check_state_fits(model, state, source)


def _check_memory(model: nn.Module, config: Mapping[str, Any], where: str) -> None:
    """Parameters and buffers (a positional table the file does not hold) against the machine's memory."""
    tensors = {id(t): (name, t) for name, t in [*model.named_parameters(), *model.named_buffers()]}.values()
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    have = memory_bytes()
    if have is None or total <= have:
        return
    name, largest = max(tensors, key=lambda nt: nt[1].numel())
    named = next(((f, d) for d in sorted(largest.shape, reverse=True) if (f := _field_for(config, d))), None)
    why = f" ({named[0]} {'are' if '/' in named[0] else 'is'} {named[1]})" if named else ""
    raise CheckpointError(f"{where}: the model it describes needs {total / 2**30:,.1f} GiB, more than this "
                          f"machine's {have / 2**30:,.1f} GiB of memory: its {name} alone is "
                          f"{tuple(largest.shape)}{why}")


def check_new_model_memory(build: Any, config: Mapping[str, Any], where: str) -> None:
    """Refuse, before anything is allocated, a model to be trained from scratch whose config (`config`: the
    model fields as given) describes more parameters and buffers than the machine's memory (`moe.n_experts:
    10**9` would otherwise be an allocator traceback). build() runs on the meta device, with the random
    number generators' state kept, so the real build draws the same weights."""
    with torch.random.fork_rng(devices=[]):
        model = _meta_model(build, config, where)
    if model is not None:
        _check_memory(model, config, where)


def check_folder_sizes(folder: Path, build: Any, config: Mapping[str, Any], weights: Path) -> None:
    """Refuse, before anything is allocated, a qkv folder whose config.json (its "config" mapping `config`)
    does not fit the weights file, or describes a model larger than the machine's memory. build(): the model
    constructor (run on the meta device here)."""
    shapes = header_shapes(weights)
    if shapes is None:
        return
    where = str(folder / CONFIG_NAME)
    _check_counts(config, shapes, where, str(weights))
    model = _meta_model(build, config, where)
    if model is None:
        return
    _check_shapes(model, shapes, config, where, str(weights))
    _check_memory(model, config, where)
