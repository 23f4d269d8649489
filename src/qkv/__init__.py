"""qkv: a Transformer you can read, train, take apart and scale."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qkv.config import ConfigError
    from qkv.models import BERT, GPT, EncoderDecoder, ModelOutput, build, presets

__version__ = "0.1.0"

# imported on first use (PEP 562): `import qkv` does not import torch, so `qkv --help` starts at once
_LAZY = {"load_model": "qkv.checkpoint", "ConfigError": "qkv.config", "BERT": "qkv.models",
         "GPT": "qkv.models",
         "EncoderDecoder": "qkv.models", "ModelOutput": "qkv.models", "build": "qkv.models",
         "presets": "qkv.models"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")


def from_pretrained(path: str | os.PathLike, *, quantize: str | None = None, **kwargs: Any) -> Any:
    """Load a model from a qkv checkpoint folder, a Hugging Face-format folder (config.json's model_type:
    gpt2, bert, ...) or a llama.cpp GGUF file (Llama / Mistral / Qwen2 / Qwen3; `dtype=` for quantized ones).
    Never executes pickled code. quantize="int8" or "int4": its Transformer blocks' projections and output
    head weight-only quantized right after loading, for inference only (qkv.nn.quant; docs/llm.md)."""
    from qkv.checkpoint import load_model

    if quantize is None:
        return load_model(path, **kwargs)
    from qkv.nn.quant import check_mode, quantize_model

    check_mode(quantize)  # before the load: a misspelt mode costs nothing
    return quantize_model(load_model(path, **kwargs), quantize)


__all__ = ["BERT", "GPT", "ConfigError", "EncoderDecoder", "ModelOutput", "__version__", "build",
           "from_pretrained", "presets"]
