"""The steps every writer of a Hugging Face model folder shares (the fine-tune recipes' OUT, `qkv export`:
qkv.export): the model written by its model_type's exporter (interop/registry.py), the token ids set from
the tokenizer, a GPT's model_type chosen from its config. A config the format cannot express is refused by
the exporter's own check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from qkv.config import ConfigError
from qkv.interop import llama, moe
from qkv.interop.registry import ExportRequest, ModelType, lookup, model_types, names
from qkv.storage import atomic_write_json


def writable_types(family: str | None = None, kind: str | None = None) -> tuple[str, ...]:
    """The model_types qkv writes (of qkv `family`, of `kind`; default: any), in registration order."""
    return names(model_types(kind=kind, family=family, writable=True))


def writer(model_type: str) -> ModelType:
    """The record of `model_type`, refused when qkv does not write it."""
    record = lookup(model_type)
    if record is None or record.exporter is None:
        raise ConfigError(f"no Hugging Face exporter for model_type {model_type!r}: qkv writes "
                          f"{', '.join(sorted(writable_types()))} folders")
    return record


def check_model(model: torch.nn.Module, request: ExportRequest) -> None:
    """Refuse, writing nothing, a model the exporter of `request.model_type` would refuse."""
    record = writer(request.model_type)
    if record.check is not None:
        record.check(model, request)


def write_model(model: torch.nn.Module, out: Path, request: ExportRequest) -> None:
    """`model` as a Hugging Face `request.model_type` folder in `out`, by that type's exporter."""
    writer(request.model_type).exporter(model, out, request)


def set_token_ids(out: Path, ids: dict[str, Any]) -> None:
    """config.json's bos/eos/pad token ids set to `ids` (one absent from `ids` is removed): the exporter
    knows the architecture, the tokenizer its ids."""
    written = json.loads((out / "config.json").read_text(encoding="utf-8"))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in ids:
            written[key] = ids[key]
        else:
            written.pop(key, None)
    atomic_write_json(written, out / "config.json")


def decoder_type(config: Any) -> str:
    """The Hugging Face model_type a qkv GPT config is written as (its exporter then checks the rest)."""
    if config.mla.enabled:
        return "deepseek_v3"
    if config.moe.n_experts:
        return moe.model_type_of(config)
    if config.position == "learned":
        return "gpt2"
    return llama.model_type_of(config)


__all__ = ["check_model", "decoder_type", "set_token_ids", "writable_types", "write_model", "writer"]
