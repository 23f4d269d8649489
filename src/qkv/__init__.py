"""qkv: a Transformer you can read, train, take apart and scale."""

from __future__ import annotations

import os
from typing import Any

from qkv.checkpoint import load_model
from qkv.config import ConfigError
from qkv.models import BERT, GPT, EncoderDecoder, ModelOutput, build, presets

__version__ = "0.1.0"


def from_pretrained(path: str | os.PathLike, **kwargs: Any) -> Any:
    """Load a model from a qkv checkpoint folder, a Hugging Face-format folder (config.json's model_type: gpt2,
    bert, ...) or a llama.cpp GGUF file (Llama / Mistral / Qwen2 / Qwen3; `dtype=` for quantized ones). Never
    executes pickled code."""
    return load_model(path, **kwargs)


__all__ = ["BERT", "GPT", "ConfigError", "EncoderDecoder", "ModelOutput", "__version__", "build",
           "from_pretrained", "presets"]
