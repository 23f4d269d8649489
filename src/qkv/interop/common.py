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

Loading holds about one copy of the weights (benchmarks/load_memory.py measures it): `HFTensors` reads a safetensors
folder's names, shapes and dtypes from the file headers and each tensor only when it is copied; every check above
runs on those shapes before anything is allocated; the model is built with its parameters on the meta device
(`build_skeleton`: buffers computed in __init__, e.g. Marian's sinusoids and Whisper's mel filters, are built
for real) and given storage in the dtype it will keep; then each parameter is filled from its pieces, one piece
at a time. A pytorch_model.bin is a pickle, which torch.load can only read whole: its tensors are held in memory
and each is released once copied.
"""

from __future__ import annotations

import json
import pickle
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

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


# safetensors' dtype names (the header's) -> torch's
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


class HFTensors(Mapping[str, Tensor]):
    """The tensors of a HF folder by name, each read from disk only when asked for (`self[name]`).

    For safetensors (one file or an index of shards) the names, shapes and dtypes come from the file headers
    (`meta(name)`), and every read opens the file just for that read, so its mapped pages are released as
    loading proceeds. A pytorch_model.bin (and its index) is a pickle: torch.load reads it whole, and its tensors
    are held in memory. Loaders rename keys (`rename`), drop them (`del`) and add small tensors the file lacks
    (`self[name] = tensor`) without reading anything."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        self._where: dict[str, tuple[Path, str]] = {}  # our name -> (file, its name in the file)
        self._meta: dict[str, Tensor] = {}  # name -> a meta tensor of the file's shape and dtype
        self._memory: dict[str, Tensor] = {}  # tensors read whole (a pickle) or added by the loader
        if (folder / SAFETENSORS).is_file():
            self.source, files = str(folder / SAFETENSORS), [folder / SAFETENSORS]
        elif (folder / SAFETENSORS_INDEX).is_file():
            self.source, files = str(folder / SAFETENSORS_INDEX), shard_files(folder / SAFETENSORS_INDEX)
        else:
            self._memory, self.source = read_hf_state(folder)  # pytorch_model.bin (weights_only) or absent
            return
        from safetensors import safe_open

        for path in files:
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for name in f.keys():
                        piece = f.get_slice(name)
                        dtype = _ST_DTYPES.get(str(piece.get_dtype()))
                        if dtype is None:  # a rarer type (fp8, ...): read this one to learn it
                            dtype = f.get_tensor(name).dtype
                        self._where[name] = (path, name)
                        self._meta[name] = torch.empty(piece.get_shape(), dtype=dtype, device="meta")
            except CheckpointError:
                raise
            except Exception as e:  # safetensors' own error type for a truncated or corrupt file
                raise CheckpointError(f"{path}: cannot be read as safetensors ({e})") from None

    # -- the Mapping protocol: names without reading, values read on access ---------------------------
    def __iter__(self) -> Iterator[str]:
        return iter([*self._where, *self._memory])

    def __len__(self) -> int:
        return len(self._where) + len(self._memory)

    def __contains__(self, name: object) -> bool:
        return name in self._where or name in self._memory

    def __getitem__(self, name: str) -> Tensor:
        if name in self._memory:
            return self._memory[name]
        path, key = self._where[name]  # KeyError for an absent name, as a dict
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                return f.get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read {key!r} ({e})") from None

    def __setitem__(self, name: str, tensor: Tensor) -> None:
        self.pop(name, None)
        self._memory[name] = tensor

    def __delitem__(self, name: str) -> None:
        if name in self._memory:
            del self._memory[name]
        else:
            del self._where[name]
            del self._meta[name]

    def pop(self, name: str, *default: Any) -> Any:
        """Drop `name` (without reading it) and return True, or `default` when absent."""
        if name not in self:
            if default:
                return default[0]
            raise KeyError(name)
        del self[name]
        return True

    def release(self, name: str) -> None:
        """Drop the in-memory tensor `name` (and its name) once it has been copied, so that a pickle's tensors are
        freed one by one as the model fills rather than all at the end. Nothing for a name read from a
        safetensors file: such a tensor is not held."""
        self._memory.pop(name, None)

    def meta(self, name: str) -> Tensor:
        """A meta tensor with `name`'s shape and dtype: nothing is read."""
        if name in self._memory:
            return self._memory[name].to("meta")
        return self._meta[name]

    def rename(self, fn: Callable[[str], str]) -> None:
        """Rename every key by `fn` (a later key renamed onto an earlier one replaces it, as in a dict)."""
        where, meta, memory = {}, {}, {}
        for k in list(self):
            new = fn(k)
            for d in (where, meta, memory):
                d.pop(new, None)
            if k in self._memory:
                memory[new] = self._memory[k]
            else:
                where[new], meta[new] = self._where[k], self._meta[k]
        self._where, self._meta, self._memory = where, meta, memory


def meta_of(state: Mapping[str, Tensor], name: str) -> Tensor:
    """The shape and dtype of `state[name]` as a meta tensor, without reading it from an HFTensors."""
    return state.meta(name) if isinstance(state, HFTensors) else state[name].to("meta")


# -- config.json's sizes against the file, before anything is built ------------------------------------
# (config.json field, its value, a file key, the dim of that key's shape the field sizes); dim None: the key is a
# template with "{}" for the layer index, and the value is the number of layers
SizeCheck = tuple[str, Any, str, int | None]


def check_sizes(state: Mapping[str, Tensor], source: str, checks: Iterable[SizeCheck]) -> None:
    """Every size config.json gives (layers, width, vocabulary, positions, ...) against the file's tensor shapes,
    read from its headers: a wrong field is named before a key map is expanded or a model built from it (a
    config saying n_layer = 10**9 or vocab_size = 10**12 would otherwise allocate until memory runs out). A key
    the file lacks is not checked here: the key map reports it as missing."""
    config = Path(source).parent / "config.json"
    for field, value, key, dim in checks:
        if not isinstance(value, int) or isinstance(value, bool):
            continue  # not a size at all: building the config says so (load_hf's "unusable value")
        if dim is None:
            layer = re.compile("^" + re.escape(key).replace(re.escape("{}"), r"(\d+)") + "$")
            found = {m.group(1) for k in state if (m := layer.match(k))}
            if value != len(found):
                raise CheckpointError(f"{config}: {field} is {value!r}, but {source} holds {len(found)} layers "
                                      f"(keys {key.replace('{}', 'N')!r})")
            continue
        if key not in state:
            continue
        shape = tuple(meta_of(state, key).shape)
        if dim >= len(shape) or value != shape[dim]:
            raise CheckpointError(f"{config}: {field} is {value!r}, but {source} has {key} of shape {shape}"
                                  + (f" ({field} would be {shape[dim]})" if dim < len(shape) else ""))


# -- building a model without allocating its weights --------------------------------------------------
M = TypeVar("M", bound=nn.Module)


# the in-place fills that initialisers (torch.nn.init, reset_parameters, init_weights) run on a parameter
_INIT_OPS = frozenset({"normal_", "uniform_", "zero_", "fill_", "copy_", "mul_", "add_", "sub_", "div_", "clamp_",
                       "erfinv_", "exponential_", "log_normal_", "bernoulli_", "random_", "cauchy_", "geometric_"})


class SkipInitOnMeta(TorchFunctionMode):
    """Initialising a meta tensor computes nothing, but torch routes some fills on meta (normal_) through its
    reference implementations, whose first use imports torch._dynamo: ~75 MB of resident memory for nothing. The
    skeleton's initialisers are skipped instead (their results would be overwritten by the file anyway)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _INIT_OPS:
            # Tensor.normal_(t, ...) passes the tensor first; torch.nn.init.normal_ passes it as tensor=
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, Tensor) and target.device.type == "meta":
                return target
        return func(*args, **kwargs)


_building = threading.local()  # .depth: how many build_skeleton calls this thread is inside
_hook = threading.Lock()
_hook_users = 0  # threads inside build_skeleton: the hook is installed while there is one
_register_parameter = nn.Module.register_parameter  # what the hook calls (set when it is installed)


def _register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    if getattr(_building, "depth", 0) and param is not None and param.device.type != "meta":
        param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
    _register_parameter(module, name, param)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """While active, every parameter a module registers in this thread is moved to the meta device at once
    (nn.Linear's torch.empty is never touched; its reset_parameters and our init_weights then skip the meta
    tensors). Buffers stay where __init__ computed them: positional tables, masks, mel filters are real. Modules
    that other threads build meanwhile are passed through untouched (the switch is per thread), and
    nn.Module.register_parameter is torch's own again once no thread is building."""
    global _hook_users, _register_parameter
    with _hook:
        if _hook_users == 0:
            _register_parameter = nn.Module.register_parameter
            nn.Module.register_parameter = _register_on_meta  # type: ignore[method-assign]
        _hook_users += 1
    _building.depth = getattr(_building, "depth", 0) + 1
    try:
        with SkipInitOnMeta():
            yield
    finally:
        _building.depth -= 1
        with _hook:
            _hook_users -= 1
            if _hook_users == 0:
                nn.Module.register_parameter = _register_parameter  # type: ignore[method-assign]


def build_skeleton(build: Callable[[], M]) -> M:
    """`build()` (a model constructor) with its parameters on the meta device and its buffers real:
    `load_hf_weights` gives the parameters storage in the dtype they will keep and fills every one of them.
    Why not torch.device("meta") and to_empty (as the Llama loader does): buffers computed in __init__ (Marian's
    sinusoidal table, Whisper's mel filters) would be left uninitialised, and tied parameters untied."""
    with _parameters_on_meta():
        return build()


def _materialise(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Give every meta parameter uninitialised CPU storage (in `dtype` when it is floating and one is given),
    keeping tied parameters tied; then cast the whole model to `dtype` (buffers and real parameters; what
    is already in it is not copied)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            if id(p) not in made:
                want = dtype if dtype is not None and p.is_floating_point() else p.dtype
                made[id(p)] = type(p)(torch.empty(p.shape, dtype=want), requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]
    left = [n for n, b in model.named_buffers() if b.device.type == "meta"]
    if left:  # a constructor that derived a buffer from a parameter: build_skeleton cannot be used for it
        raise CheckpointError(f"{type(model).__name__}: buffer(s) {left[:3]} were left on the meta device (a loader bug)")
    if dtype is not None:
        model.to(dtype=dtype)


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
            f"{source}: unexpected key {unexpected[0]!r}" + (f" (and {len(unexpected) - 1} more: "
                                                            f"{unexpected[1:4]})" if len(unexpected) > 1 else "")
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
        raise CheckpointError(f"{source}: cannot concatenate {hfs} into {ours!r}: shapes {shapes} differ beyond dim 0")


def convert_state(
    hf_state: Mapping[str, Tensor],
    mapping: Mapping[str, str],
    *,
    transforms: Mapping[str, Transform] | None = None,
    ignore: Iterable[str] = (),
    source: str = "checkpoint",
) -> tuple[dict[str, Tensor], dict[str, list[str]]]:
    """Rename (and transform / concatenate) HF tensors into our key space, all at once (the loaders stream
    instead: load_hf_weights).

    mapping: concrete keys (already expanded). ignore: key templates ("{}" = any index) of tensors that
    may be in the file but carry nothing we need (HF's causal-mask buffers, position_ids, ...).
    Returns (our state dict, our_key -> the HF keys it was built from) for error messages."""
    compiled = [(_pattern(t), fn) for t, fn in (transforms or {}).items()]
    _check_names(hf_state, mapping, ignore, source)
    sources = _groups(mapping)
    state = {}
    for ours, hfs in sources.items():
        ts = [_transform(hf_state[hf], hf, compiled) for hf in hfs]
        _check_concatenable(ours, hfs, [tuple(t.shape) for t in ts], source)
        state[ours] = ts[0] if len(ts) == 1 else torch.cat(ts, dim=0)
    return state, sources


def _half_dtype(dtypes: set[torch.dtype]) -> torch.dtype | None:
    """The file's dtype when its floating tensors are all bf16 or all fp16 (the model keeps it), else None."""
    if len(dtypes) == 1 and (half := next(iter(dtypes))) in (torch.bfloat16, torch.float16):
        return half
    return None


def load_converted(model: nn.Module, state: Mapping[str, Tensor], sources: Mapping[str, list[str]],
                   source: str = "checkpoint") -> None:
    """Copy our-key tensors into `model` (a built model or a `build_skeleton`) after the library's one fit check
    (every parameter filled, tied copies excepted; every shape equal), naming the file's keys in errors. A file
    whose floating tensors are all bf16 (or all fp16) keeps that dtype, as transformers loads it: the model is
    cast to it first, so the copies are exact and nothing is held twice in fp32. Files of other (or mixed) dtypes
    load into the model's dtype."""
    check_state_fits(model, state, source, name=lambda k: ", ".join(sources.get(k, [k])))
    _materialise(model, _half_dtype({t.dtype for t in state.values() if t.is_floating_point()}))
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
    tied: Mapping[str, tuple[str, str]] | None = None,
) -> nn.Module:
    """Fill `model` (a `build_skeleton`, or a built model) from `hf_state` (an HFTensors, or any mapping) through
    `mapping`, holding one HF tensor at a time beside the model.

    Everything is checked before a byte is read or a parameter allocated, from the tensors' shapes and dtypes
    (the transforms run on meta tensors to learn theirs): the names (missing / unexpected), that the pieces of
    a fused parameter concatenate, and check_state_fits (every parameter filled, every shape equal, errors
    naming the file's keys). The dtype rule is load_converted's: a file whose floating tensors are all bf16 (or
    all fp16) keeps that dtype, else the model's. Then each parameter gets its storage and is filled piece by
    piece (a fused q/k/v is never concatenated: each piece is copied into its rows).
    tied: {file key: (the file key it must equal, the error if it does not)}, for copies of tied tensors that a
    file may store; checked after the copy, against the parameter the reference filled, so nothing is read twice.
    An HFTensors is consumed: the tensors it holds in memory (a pickle's) are released as they are copied."""
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
    _materialise(model, _half_dtype(dtypes))
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
