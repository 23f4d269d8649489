"""Hugging Face-format folders -> qkv models, through one explicit key map per family.

Each family module registers a record per model_type it reads (interop/registry.py); `load_hf(folder)`
dispatches on config.json's `model_type`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qkv.config import ConfigError
from qkv.interop.registry import lookup, model_types, names
from qkv.storage import CheckpointError, read_config


def load_hf(folder: str | Path) -> Any:
    folder = Path(folder)
    meta = read_config(folder)
    mt = meta.get("model_type")
    if not isinstance(mt, str):
        raise CheckpointError(f"{folder}/config.json: model_type must be a string, got {mt!r}")
    record = lookup(mt)
    if record is None:
        raise CheckpointError(f"{folder}: Hugging Face model_type {mt!r} is not supported; "
                              f"supported: {sorted(names(model_types()))}")
    try:
        return record.loader(folder, meta)
    except (CheckpointError, ConfigError):
        raise
    except KeyError as e:  # a loader reads a field config.json does not have: one line naming it
        if not (isinstance(e.args[0], str) and e.args[0] not in meta):
            raise
        raise CheckpointError(
            f"{folder}/config.json: {mt} needs the field {e.args[0]!r}, which is missing"
        ) from None
    except (TypeError, ValueError) as e:  # e.g. int("forty")
        raise CheckpointError(f"{folder}/config.json: a {mt} field has an unusable value ({e})") from None
    except (MemoryError, RuntimeError) as e:  # a size no weight shape checks (e.g. a computed position table)
        if isinstance(e, RuntimeError) and "allocate" not in str(e):
            raise
        raise CheckpointError(
            f"{folder}/config.json: the {mt} model it describes does not fit in memory "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'out of memory'})"
        ) from None
