"""qkv: a Transformer you can read, train, take apart and scale."""

from __future__ import annotations

import os
from typing import Any

from qkv.checkpoint import load_model
from qkv.config import ConfigError
from qkv.models import BERT, GPT, EncoderDecoder, ModelOutput, build, presets

__version__ = "0.1.0"


def from_pretrained(path: str | os.PathLike, *, quantize: str | None = None, **kwargs: Any) -> Any:
    """Load a model from a qkv checkpoint folder or a Hugging Face-format folder (config.json's
    model_type: gpt2, bert, ...). Never executes pickled code. quantize="int8" or "int4": its Transformer
    blocks' projections and output head weight-only quantized right after loading, for inference only
    (qkv.nn.quant; docs/llm.md)."""
    if quantize is None:
        return load_model(path, **kwargs)
    from qkv.nn.quant import check_mode, quantize_model

    check_mode(quantize)  # before the load: a misspelt mode costs nothing
    return quantize_model(load_model(path, **kwargs), quantize)


__all__ = ["BERT", "GPT", "ConfigError", "EncoderDecoder", "ModelOutput", "__version__", "build",
           "from_pretrained", "presets"]
