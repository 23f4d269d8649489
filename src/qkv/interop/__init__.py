"""Hugging Face-format folders -> qkv models, through one explicit key map per family.

Each family module registers `model_type -> loader` in LOADERS; `load_hf(folder)` dispatches on
config.json's `model_type`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkv.config import ConfigError
from qkv.storage import CheckpointError, read_config

LOADERS: dict[str, Callable[[Path, dict[str, Any]], Any]] = {}

# model_type -> module that registers its loader (imported lazily, so a missing one costs nothing)
_MODULES = {
    "gpt2": "qkv.interop.gpt2",
    "bert": "qkv.interop.bert",
    "roberta": "qkv.interop.roberta",
    "xlm-roberta": "qkv.interop.roberta",
    "distilbert": "qkv.interop.distilbert",
    "deberta-v2": "qkv.interop.deberta",
    "vit": "qkv.interop.vit",
    "resnet": "qkv.interop.resnet",
    "swin": "qkv.interop.swin",
    "whisper": "qkv.interop.whisper",
    "llava": "qkv.interop.llava",
    "clip": "qkv.interop.clip",
    "siglip": "qkv.interop.clip",
    "idefics3": "qkv.interop.smolvlm",
    "smolvlm": "qkv.interop.smolvlm",
    "llama": "qkv.interop.llama",
    "mistral": "qkv.interop.llama",
    "qwen2": "qkv.interop.llama",
    "qwen3": "qkv.interop.llama",
    "mixtral": "qkv.interop.moe",
    "qwen2_moe": "qkv.interop.moe",
    "qwen3_moe": "qkv.interop.moe",
    "deepseek_v3": "qkv.interop.deepseek",
    "deepseek_v2": "qkv.interop.deepseek",
    "t5": "qkv.interop.t5",
    "bart": "qkv.interop.bart",
    "marian": "qkv.interop.bart",
}


# model_type -> the kind of model it loads as (qkv.models kinds), readable without loading any weights
KINDS = {"gpt2": "decoder", "llama": "decoder", "mistral": "decoder", "qwen2": "decoder", "qwen3": "decoder",
         "mixtral": "decoder", "qwen2_moe": "decoder", "qwen3_moe": "decoder", "deepseek_v3": "decoder",
         "bert": "encoder", "roberta": "encoder", "xlm-roberta": "encoder", "distilbert": "encoder",
         "deberta-v2": "encoder",
         "t5": "seq2seq", "bart": "seq2seq", "marian": "seq2seq", "vit": "image", "resnet": "image",
         "swin": "image", "whisper": "audio", "clip": "dual", "siglip": "dual"}


def load_hf(folder: str | Path) -> Any:
    folder = Path(folder)
    meta = read_config(folder)
    mt = meta.get("model_type")
    if not isinstance(mt, str):
        raise CheckpointError(f"{folder}/config.json: model_type must be a string, got {mt!r}")
    if mt not in LOADERS and mt in _MODULES:
        try:
            importlib.import_module(_MODULES[mt])
        except ModuleNotFoundError as e:
            raise CheckpointError(f"no loader for Hugging Face model_type {mt!r} yet ({e})") from None
    if mt not in LOADERS:
        raise CheckpointError(f"{folder}: Hugging Face model_type {mt!r} is not supported; "
                              f"supported: {sorted(_MODULES)}")
    try:
        return LOADERS[mt](folder, meta)
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
