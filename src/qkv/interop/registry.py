"""What qkv knows about each Hugging Face model_type, as one record registered where its family is defined.

A family module (interop/llama.py, bert.py, ...) calls `register(ModelType(...))` for each model_type it
reads; every table elsewhere (the types `qkv export` writes, the kinds `qkv finetune` reads from a
config.json, the fields `qkv info` sizes a KV cache from, the vision-language types) is a query on these
records. Every exporter has one signature: `exporter(model, out, request)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

from qkv.config import ConfigError
from qkv.storage import read_config

# The modules that register model types, imported together on the first query (a record is found by its
# model_type, which names no module). Records are listed in this order (then each module's own): the first
# of a family is what `qkv export` writes a model of that family as when no type is asked for (bert before
# roberta and distilbert).
FAMILY_MODULES = ("gpt2", "llama", "moe", "deepseek", "bert", "roberta", "distilbert", "deberta", "t5",
                  "bart", "vit", "resnet", "swin", "whisper", "clip", "llava", "smolvlm", "detr")


@dataclass(frozen=True)
class ExportRequest:
    """What an exporter is told beyond the model and OUT."""

    model_type: str
    source: Path | None = None  # the model folder the model was loaded from (its config.json, a VLM's files)
    labels: dict[int, str] | None = None  # a classifier's class names by id, where the caller knows them
    preprocessor: dict[str, Any] | None = None  # an image classifier's preprocessor_config.json

    def base_config(self) -> dict[str, Any] | None:
        """The source's config.json when it is a Hugging Face folder's (None for a qkv folder, or none): an
        exporter keeps the fields it does not write."""
        meta = read_config(self.source) if self.source is not None else None
        return meta if meta is not None and "qkv_family" not in meta else None

    def source_config(self) -> dict[str, Any]:
        """base_config() for an exporter that writes only the folder the model was loaded from (its
        architecture is that config.json, kept as it is)."""
        meta = self.base_config()
        if meta is None or meta.get("model_type") != self.model_type:
            raise ConfigError(f"a {self.model_type} folder is written from the {self.model_type} folder the "
                              "model was loaded from (its config.json); this model has none")
        return meta


Loader = Callable[[Path, dict[str, Any]], Any]  # (folder, its config.json) -> a qkv model
Exporter = Callable[[Any, Path, ExportRequest], object]  # writes the model's folder into OUT
Check = Callable[[Any, ExportRequest], object]  # raises what the exporter would, before anything is written


@dataclass(frozen=True)
class ModelType:
    """One Hugging Face model_type: how qkv reads it, what it becomes, and how qkv writes it (if it does)."""

    name: str  # config.json's model_type
    kind: str  # the kind of qkv model it loads as (qkv.models.registry.KINDS), known before any weight
    family: str  # the qkv family of that model (a model's `family`): what `qkv export` matches a model by
    loader: Loader
    exporter: Exporter | None = None  # None: qkv reads this format but does not write it
    _: KW_ONLY
    check: Check | None = None  # refuses, writing nothing, what the exporter would (before a recipe trains)
    # the config.json fields `qkv info` sizes the KV cache from: a folder lacking one is refused (the loader
    # would default it, e.g. the context, and size another model)
    sizing_fields: tuple[str, ...] = ()
    layout: Any = None  # an encoder's interop.bert.Layout: the names its folders are read and written with

    @property
    def module(self) -> str:
        return self.loader.__module__


_RECORDS: dict[str, ModelType] = {}
_loaded = False


def register(*records: ModelType) -> None:
    """Add `records` (at the import of the module that defines their family)."""
    for record in records:
        if _RECORDS.get(record.name, record) != record:
            raise ValueError(f"model_type {record.name!r} is registered twice "
                             f"({_RECORDS[record.name].module}, {record.module})")
        _RECORDS[record.name] = record


def _load_families() -> None:
    """Import every family module once: each registers its records as it is imported."""
    global _loaded
    if not _loaded:
        for name in FAMILY_MODULES:
            importlib.import_module(f"qkv.interop.{name}")
        _loaded = True


def lookup(name: object) -> ModelType | None:
    """The record of Hugging Face model_type `name` (None: qkv does not read it)."""
    _load_families()
    return _RECORDS.get(name) if isinstance(name, str) else None


def model_types(*, kind: str | None = None, family: str | None = None,
                writable: bool = False) -> tuple[ModelType, ...]:
    """The records of `kind` and of `family` (default: any), only those qkv writes if `writable`; in
    FAMILY_MODULES' order, each module's in the order it registered them."""
    _load_families()
    return tuple(r for r in sorted(_RECORDS.values(), key=_module_order) if (kind is None or r.kind == kind)
                 and (family is None or r.family == family) and (r.exporter is not None or not writable))


def _module_order(record: ModelType) -> int:
    name = record.module.removeprefix("qkv.interop.")
    return FAMILY_MODULES.index(name) if name in FAMILY_MODULES else len(FAMILY_MODULES)


def names(records: tuple[ModelType, ...]) -> tuple[str, ...]:
    return tuple(r.name for r in records)


def is_vision_language(name: object) -> bool:
    """Whether model_type `name` is a vision-language model (a decoder reading images in its prompts)."""
    record = lookup(name)
    return record is not None and record.family == "llava"


__all__ = ["FAMILY_MODULES", "Check", "ExportRequest", "Exporter", "Loader", "ModelType",
           "is_vision_language", "lookup", "model_types", "names", "register"]
