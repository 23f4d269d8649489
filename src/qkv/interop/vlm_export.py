"""What the writers of qkv's vision-language models (models/vlm.py) share: `llava` (interop/llava.py,
LlavaForConditionalGeneration) and `idefics3` / `smolvlm` (interop/smolvlm.py, Idefics3- /
SmolVLMForConditionalGeneration) folders are the same three parts under other key prefixes:
  - the language model: written by the Llama exporter (interop/llama.py), its "model." keys moved under the
    family's prefix ("lm_head." stays), its config.json becoming the folder's text_config;
  - the vision tower and the projector: the family's own keys;
  - the folder's other files (the processor, tokenizer and chat template configs) carried over from the
    source folder unchanged.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor

from qkv.interop.common import write_hf_folder
from qkv.interop.export_tokenizer import copy_tokenizer_files
from qkv.interop.llama import export_llama

# the source folder's processor files, carried into the export with its tokenizer, chat template and
# generation files (config.json is written, the weights are the model's). A list, not a pattern: a folder may
# hold other JSON (a training run's records) that does not describe the exported model.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def language_state(model: torch.nn.Module, prefix: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The language model's tensors under Hugging Face names ("model." -> `prefix`, "lm_head." kept) and its
    config.json (the text_config of the vision-language folder), as the Llama exporter writes them."""
    with tempfile.TemporaryDirectory() as tmp:
        export_llama(model, tmp)
        text_config = json.loads((Path(tmp) / "config.json").read_text(encoding="utf-8"))
        state = {k if k.startswith("lm_head.") else prefix + k[len("model."):]: t
                 for k, t in load_file(Path(tmp) / "model.safetensors").items()}
    return state, text_config


def source_tensors(source: Path, canonical_key: Callable[[str], str], keep: str) -> dict[str, Tensor]:
    """The source folder's tensors whose canonical name starts with `keep`, read alone (a 7B folder's
    language model is never loaded for this)."""
    out: dict[str, Tensor] = {}
    for f in sorted(Path(source).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():  # noqa: SIM118  (safe_open is not a mapping)
                if canonical_key(k).startswith(keep):
                    out[canonical_key(k)] = sf.get_tensor(k)
    return out


def write_vlm_folder(out: str | os.PathLike, state: dict[str, Tensor], hf_config: dict[str, Any],
                     source: str | os.PathLike | None) -> Path:
    """config.json and model.safetensors, plus the source folder's processor, tokenizer and chat template
    files (never a file onto itself)."""
    out = write_hf_folder(out, state, hf_config)
    if source is not None:
        copy_tokenizer_files(Path(source), out, also=PROCESSOR_FILES)
    return out


__all__ = ["PROCESSOR_FILES", "language_state", "source_tensors", "write_vlm_folder"]
