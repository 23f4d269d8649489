"""What `qkv serve` serves: a decoder-only model and the tokenizer that turns text into its ids and back.

MODEL is a qkv run folder (its task's tokenizer), a qkv checkpoint folder, or a Hugging Face folder
(tokenizer.json, chat template from tokenizer_config.json / chat_template.jinja: qkv.interop.tokenizer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkv.config import ConfigError
from qkv.interop.gguf_model import is_gguf
from qkv.interop.gguf_tokenizer import load_gguf_tokenizer
from qkv.interop.smolvlm import folder_processor
from qkv.interop.tokenizer import load_hf_tokenizer
from qkv.run import (
    folder_tokenizer,
    load_assistant,
    load_model_any,
    load_run_task,
    model_folder,
    run_folder_of,
)


@dataclass
class TextCodec:
    """encode / decode / chat template behind one small interface, whatever tokenizer the folder has."""

    tokenizer: Any
    eos_ids: set[int] = field(default_factory=set)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        try:  # qkv tokenizers skip special tokens by default; HF (interop) ones take skip_special_tokens
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        except TypeError:
            return self.tokenizer.decode(ids)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens spelled out (a log-probability entry names its token)."""
        try:
            return self.tokenizer.decode([token_id], skip_special_tokens=False)
        except TypeError:
            return self.tokenizer.decode([token_id])

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer.chat_template)  # a field of every qkv.tokenizer.TextTokenizer

    def chat_prompt(self, messages: list[dict[str, Any]], **variables: Any) -> list[int]:
        """The chat template's rendering of `messages` with the assistant's turn opened, as token ids;
        variables: the template's others (tools)."""
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       **variables))


@dataclass
class Served:
    model: torch.nn.Module
    codec: TextCodec
    name: str
    path: Path
    # when the model was loaded (Unix seconds): GET /v1/models' "created"
    created: int = field(default_factory=lambda: int(time.time()))
    # a vision-language model's image preprocessing (interop.smolvlm.folder_processor); None: text only
    images: Any = None
    quantize: str | None = None  # the weight-only quantization it was loaded with (a draft model's too)


def load_served(path: str | Path, name: str | None = None, quantize: str | None = None) -> Served:
    """Model + tokenizer of a run folder, a qkv checkpoint folder, a Hugging Face folder or a GGUF file
    (quantize: "int8" / "int4" weight-only, qkv.nn.quant)."""
    path = Path(path)
    model = load_model_any(path, quantize).eval()
    if getattr(model, "is_seq2seq", True):
        raise ConfigError(f"{path}: qkv serve serves decoder-only language models (this is "
                          f"{type(model).__name__})")
    folder = model_folder(path)
    if run_folder_of(path) is not None:
        tok = load_run_task(path).tokenizer
        eos: set[int] = set()
    elif is_gguf(folder) or (
        (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()
    ):
        tok = load_gguf_tokenizer(folder) if is_gguf(folder) else load_hf_tokenizer(folder)
        # the template's end-of-turn token too (ChatML's <|im_end|> where eos is <|endoftext|>), as qkv chat
        # stops
        eos = {i for i in tok.end_of_turn_ids if i < model.output_vocab_size}
    else:
        tok, eos = folder_tokenizer(folder), set()
    images = None
    if getattr(model, "image_features", None) is not None:  # a LLaVA / Idefics3: its folder's preprocessing
        images = folder_processor(folder)
    return Served(model, TextCodec(tok, eos), name or path.resolve().name, path, images=images,
                  quantize=quantize)


def load_draft(path: str | Path, served: Served) -> torch.nn.Module:
    """The draft model of `--speculative MODEL`: a folder (or GGUF file) loaded as the served model was
    (its quantize, device and floating dtype), refused in one line unless its tokenizer has the served
    model's vocabulary (the same ids must mean the same text)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"--speculative {path}: no such draft model folder (or 'prompt-lookup')")
    if not callable(getattr(getattr(served.codec.tokenizer, "tokenizer", None), "get_vocab", None)):
        raise ConfigError(f"--speculative {path}: a draft model needs a served model with a Hugging Face "
                          "tokenizer (tokenizer.json) to compare vocabularies; use --speculative "
                          "prompt-lookup")
    draft = load_assistant(path, served.codec.tokenizer, served.quantize)
    if getattr(draft, "is_seq2seq", True):
        raise ConfigError(f"--speculative {path}: the draft model must be a decoder-only language model "
                          f"(this is {type(draft).__name__})")
    target = next(served.model.parameters())
    own = next(draft.parameters())
    if own.device != target.device or (own.is_floating_point() and own.dtype != target.dtype):
        draft = draft.to(device=target.device, dtype=target.dtype if target.is_floating_point() else None)
    return draft
