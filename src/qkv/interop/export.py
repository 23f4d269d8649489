"""The Hugging Face formats qkv writes: EXPORTERS, the one table of Hugging Face model_type -> the function
that writes a model in that format (what transformers loads), and the steps every writer of a model folder
shares (the fine-tune recipes' OUT, `qkv export`: qkv.export). A config the format cannot express is
refused by the exporter's own check.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path
from typing import Any

import torch

from qkv.config import ConfigError

DECODERS = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
# Hugging Face model_type -> "module:function(model, folder)" writing that format (what transformers loads);
# a function taking `model_type` or `source` (the folder or run the model came from) is given them
EXPORTERS = {"gpt2": "qkv.interop.gpt2:export_gpt2", **{mt: "qkv.interop.llama:export_llama" for mt in
                                                      ("llama", "mistral", "qwen2", "qwen3")},
             **{mt: "qkv.interop.moe:export_moe" for mt in ("mixtral", "qwen2_moe", "qwen3_moe")},
             "deepseek_v3": "qkv.interop.deepseek:export_deepseek",
             "llava": "qkv.interop.vlm_export:export_llava",
             **{mt: "qkv.interop.vlm_export:export_idefics3" for mt in ("idefics3", "smolvlm")}}


def write_model(model: torch.nn.Module, out: Path, model_type: str, source: Path | None = None,
                exporters: dict[str, str] = EXPORTERS) -> None:
    """`model` as a Hugging Face `model_type` folder in `out`, by the `exporters` entry for that type."""
    if model_type not in exporters:
        raise ConfigError(f"no Hugging Face exporter for model_type {model_type!r}: qkv writes "
                          f"{', '.join(sorted(exporters))} folders")
    module, _, name = exporters[model_type].partition(":")
    fn = getattr(importlib.import_module(module), name)
    params = inspect.signature(fn).parameters
    fn(model, out, **({"model_type": model_type} if "model_type" in params else {}),
       **({"source": source} if "source" in params else {}))


def set_token_ids(out: Path, ids: dict[str, Any]) -> None:
    """config.json's bos/eos/pad token ids set to `ids` (one absent from `ids` is removed): the exporter
    knows the architecture, the tokenizer its ids."""
    from qkv.storage import atomic_write_json

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
        from qkv.interop.moe import model_type_of

        return model_type_of(config)
    if config.position == "learned":
        return "gpt2"
    from qkv.interop.llama import model_type_of

    return model_type_of(config)


__all__ = ["DECODERS", "EXPORTERS", "decoder_type", "set_token_ids", "write_model"]
