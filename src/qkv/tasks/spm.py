"""SentencePiece tokenizers of Hugging Face folders that have no tokenizer.json, through the `sentencepiece`
package (the optional extra `qkv[seq2seq]`):

  Marian / OPUS-MT   source.spm (source text -> pieces), target.spm (pieces -> target text) and vocab.json
                     (piece -> id, one vocabulary for both sides); eos (</s>) appended, as MarianTokenizer
  T5 (slow files)    spiece.model (pieces and ids), eos (</s>) appended, as T5Tokenizer

encode(text) -> ids, decode(ids) -> text (special tokens skipped), the interface find_tokenizer's other
tokenizers have. Folders with a tokenizer.json never come here (the `tokenizers` package reads those).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qkv.extras import require


def _processor(path: Path) -> Any:
    spm = require("sentencepiece", f"the SentencePiece tokenizer {path.name}")
    sp = spm.SentencePieceProcessor()
    sp.Load(str(path))
    return sp


class MarianSPTokenizer:
    """Marian's two SentencePiece models over one vocab.json."""

    def __init__(self, folder: Path) -> None:
        self.source, self.target = _processor(folder / "source.spm"), _processor(folder / "target.spm")
        vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        self.vocab: dict[str, int] = {str(k): int(v) for k, v in vocab.items()}
        self.pieces = {i: p for p, i in self.vocab.items()}
        self.eos_id, self.unk_id = self.vocab.get("</s>", 0), self.vocab.get("<unk>", 1)
        self.pad_id = self.vocab.get("<pad>", len(self.vocab) - 1)
        self.special = {self.eos_id, self.unk_id, self.pad_id}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.get(p, self.unk_id) for p in self.source.encode(text, out_type=str)] + [self.eos_id]

    def encode_target(self, text: str) -> list[int]:
        """A target sentence (labels for fine-tuning): the target model's pieces."""
        return [self.vocab.get(p, self.unk_id) for p in self.target.encode(text, out_type=str)] + [self.eos_id]

    def decode(self, ids: list[int]) -> str:
        pieces = [self.pieces[i] for i in ids if i not in self.special and i in self.pieces]
        # a piece the SentencePiece model does not know comes back verbatim: its word marks become spaces
        return self.target.decode_pieces(pieces).replace("\u2581", " ").strip()

    def get_vocab_size(self) -> int:
        return len(self.vocab)


class SPTokenizer:
    """One SentencePiece model whose ids are the model's ids (T5's spiece.model), eos appended."""

    def __init__(self, path: Path) -> None:
        self.sp = _processor(path)
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else 1
        self.special = {i for i in (self.sp.pad_id(), self.sp.eos_id(), self.sp.unk_id(), self.sp.bos_id()) if i >= 0}

    def encode(self, text: str) -> list[int]:
        return list(self.sp.encode(text)) + [self.eos_id]

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([i for i in ids if i not in self.special and i < self.sp.get_piece_size()])

    def get_vocab_size(self) -> int:
        return int(self.sp.get_piece_size())


def sentencepiece_tokenizer(folder: str | Path) -> Any:
    """The SentencePiece tokenizer of `folder`, or None when it has none."""
    folder = Path(folder)
    if (folder / "source.spm").is_file() and (folder / "vocab.json").is_file():
        return MarianSPTokenizer(folder)
    if (folder / "spiece.model").is_file():
        return SPTokenizer(folder / "spiece.model")
    return None
