"""Model folders: `config.json` (family + config) and `model.safetensors`. Atomic writes, no pickle.

A folder written by `save_model` (qkv.storage) rebuilds its model from itself alone: `load_model(folder)`
(= `qkv.from_pretrained`). Hugging Face-format folders and GGUF files are read by qkv.interop instead
(dispatch below).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from torch import nn

from qkv.config import ConfigError, from_dict
from qkv.folder_sizes import check_folder_sizes
from qkv.generate.config import GenerationConfig
from qkv.interop import load_hf
from qkv.interop.gguf_model import is_gguf, load_gguf
from qkv.models.registry import family
from qkv.storage import (  # noqa: F401  (the checkpoint API, re-exported from the storage layer)
    CONFIG_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    check_saved_config,
    check_state_fits,
    clean_state_dict,
    config_changes,
    describe_changes,
    load_state_into,
    read_config,
    read_weights,
    save_model,
    umask_mode,
    unwrap,
)


def load_model(path: str | os.PathLike, *, map_location: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> nn.Module:
    """Rebuild a model from a qkv folder, a Hugging Face folder (by config.json's model_type) or a llama.cpp
    GGUF file. A generation_config.json beside it becomes the model's generation defaults
    (model.generation_defaults()). dtype: the floating-point type of the weights (a GGUF file's are
    dequantized straight into it)."""
    folder = Path(path)

    if is_gguf(folder):
        return load_gguf(folder, dtype).to(map_location)
    if dtype is not None:
        return load_model(folder, map_location=map_location).to(dtype)
    meta = read_config(folder)
    if folder.is_file():  # the path of the folder's config.json itself
        folder = folder.parent
    model = _load(folder, meta, map_location)
    try:
        generation = GenerationConfig.from_model_folder(folder).explicit()
    # transformers loads such a folder too, with config.json's settings: so do we, and say so
    except ConfigError as e:
        warnings.warn(f"{e}: its generation settings are not used (config.json's are)", stacklevel=2)
        return _transformers_defaults(model, meta)
    if (folder / "generation_config.json").is_file() and hasattr(model, "folder_generation_config"):
        # transformers (5.x) takes a folder's generation settings from generation_config.json alone when there
        # is one:
        # the num_beams, max_length, ... an older config.json holds count only without it; its token ids stay,
        # as the fallback of ids the file leaves out
        model.folder_generation_config = {k: v for k, v in model.folder_generation_config.items()
                                              if k in TOKEN_IDS}
        model.folder_generation_config.update(generation)
    return _transformers_defaults(model, meta)


TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


# transformers' GenerationConfig defaults where qkv's own differ: a Hugging Face folder that leaves them out
# decodes as transformers decodes it. early_stopping: transformers' heuristic (False) ends a beam search once
# the best open beam, scored at its current length, cannot beat the worst finished one, which can stop it
# before a longer, better-scoring hypothesis (qkv's own default, "never", is the exact bound).
HF_GENERATION_DEFAULTS = {"early_stopping": False}


def _transformers_defaults(model: nn.Module, meta: dict) -> nn.Module:
    if "qkv_family" not in meta and hasattr(model, "folder_generation_config"):
        model.folder_generation_config = {**HF_GENERATION_DEFAULTS, **model.folder_generation_config}
    return model


def _load(folder: Path, meta: dict, map_location: str | torch.device) -> nn.Module:
    if "qkv_family" not in meta:
        if "model_type" in meta:
            model = load_hf(folder)  # read on the CPU, then moved as a qkv folder's tensors are
            return model if torch.device(map_location).type == "cpu" else model.to(map_location)
        raise CheckpointError(f"{folder}/config.json names neither a qkv family nor a Hugging Face "
                              "model_type")
    if not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"{folder}/{CONFIG_NAME} has no 'config' mapping beside 'qkv_family'")
    try:
        fam = family(meta["qkv_family"])
        config = from_dict(fam.config_class, meta["config"])
    except ConfigError as e:
        raise CheckpointError(f"{folder}: {e}") from None
    weights = folder / WEIGHTS_NAME
    if not weights.is_file():
        raise CheckpointError(f"{folder} has no {WEIGHTS_NAME}")
    # config.json is input: its sizes against the file's header (and the machine's memory) before any
    # allocation
    check_folder_sizes(folder, lambda: fam.model_class(config), meta["config"], weights)
    model = fam.model_class(config)
    state, metadata = read_weights(weights, str(map_location))
    load_state_into(model, state, str(weights))
    # after the shape check: a wrong family's error names that
    check_saved_config(weights, metadata, meta["config"])
    return model
