"""What every qkv tokenizer offers its callers: `TextTokenizer`, a typing.Protocol.

    encode(text) -> list[int]        the ids, with whatever special tokens the tokenizer itself adds
    decode(ids) -> str               the text (each kind's default for special tokens: see below)
    bos_id / eos_id / pad_id         int, or None where the vocabulary has no such token
    vocab_size                       ids are in [0, vocab_size)
    chat_template                    the Jinja2 source, or None; where it is set,
                                     apply_chat_template(messages, add_generation_prompt=..., tokenize=...)
                                     renders a conversation

The kinds that implement it:
  qkv.tasks.tokenizers   CharTokenizer, WordTokenizer, BPETokenizer (a task's vocabulary; decode skips
                         specials)
  qkv.interop.tokenizer  HFTokenizer: a Hugging Face tokenizer.json (+ its special tokens and chat template),
                         a GGUF file's vocabulary, a BERT vocab.txt (decode keeps specials unless built with
                         skip_special_tokens=True, as find_tokenizer builds it)
  qkv.tasks.spm          Marian's and T5's SentencePiece models (decode skips specials)

Callers take a `TextTokenizer` and call these directly: no probing for `.ids` on what encode returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class TextTokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    chat_template: str | None

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


__all__ = ["TextTokenizer"]
