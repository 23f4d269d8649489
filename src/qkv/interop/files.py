"""The tensors of a Hugging Face folder: model.safetensors (or its sharded index), else pytorch_model.bin (or
its index) through torch.load(weights_only=True), so that reading never unpickles arbitrary code.

`HFTensors` reads a safetensors folder's names, shapes and dtypes from the file headers and each tensor only
when it is asked for, so the loaders (interop/common.py) check everything on shapes before anything is
allocated and then hold one tensor at a time beside the model. A pytorch_model.bin is a pickle, which
torch.load can only read whole: its tensors are held in memory and each is released once copied.
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor

from qkv.storage import CheckpointError

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"


def _load_torch_bin(path: Path) -> dict[str, Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # never unpickles code
    except Exception as e:  # UnpicklingError for disallowed globals, RuntimeError for a corrupt file
        # torch's text is many lines and suggests weights_only=False, which would run the file's code: keep
        # the one line that says what was found
        # ("Unsupported global: GLOBAL builtins.print", "unsupported GLOBAL posix.system whose module posix is
        # blocked": torch words it by how dangerous the global is)
        found = re.search(r"GLOBAL (\S+)", str(e))
        if found is None and not isinstance(e, pickle.UnpicklingError):
            first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            raise CheckpointError(f"{path}: cannot be read as a plain tensor state dict ({first})") from None
        called = f" (it would call {found.group(1)})" if found else ""
        raise CheckpointError(
            f"{path}: refused: it holds pickled objects other than tensors{called}; loading them "
            "would run code from the file. Convert it to safetensors."
        ) from None
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a mapping of names to tensors")
    return dict(state)


def _load_safetensors(path: Path) -> dict[str, Tensor]:
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
    loading proceeds. A pytorch_model.bin (and its index) is a pickle: torch.load reads it whole, and its
    tensors are held in memory. Loaders rename keys (`rename`), drop them (`del`) and add small tensors the
    file lacks (`self[name] = tensor`) without reading anything."""

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
        """Drop the in-memory tensor `name` (and its name) once it has been copied, so that a pickle's tensors
        are freed one by one as the model fills rather than all at the end. Nothing for a name read from a
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

