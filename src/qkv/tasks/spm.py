"""SentencePiece tokenizers of Hugging Face folders that have no tokenizer.json, through the `sentencepiece`
package (the optional extra `qkv[seq2seq]`):

  Marian / OPUS-MT   source.spm (source text -> pieces), target.spm (pieces -> target text) and vocab.json
                     (piece -> id, one vocabulary for both sides); eos (</s>) appended, as MarianTokenizer
  T5 (slow files)    spiece.model (pieces and ids) + the sentinels <extra_id_N> after them, eos (</s>)
                     appended, as T5Tokenizer (only when config.json's model_type is "t5")

encode(text) -> ids, decode(ids) -> text (special tokens skipped): each is a qkv.tokenizer.TextTokenizer, as
find_tokenizer's other tokenizers are. Folders with a tokenizer.json never come here (the `tokenizers` package
reads those).
"""

from __future__ import annotations

import json
import re
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
        self.bos_id: int | None = None  # Marian starts a target from pad, not a bos token
        self.chat_template: str | None = None
        self.special = {self.eos_id, self.unk_id, self.pad_id}

    def encode(self, text: str) -> list[int]:
        pieces = self.source.encode(text, out_type=str)
        return [self.vocab.get(p, self.unk_id) for p in pieces] + [self.eos_id]

    def encode_target(self, text: str) -> list[int]:
        """A target sentence (labels for fine-tuning): the target model's pieces."""
        pieces = self.target.encode(text, out_type=str)
        return [self.vocab.get(p, self.unk_id) for p in pieces] + [self.eos_id]

    def decode(self, ids: list[int]) -> str:
        pieces = [self.pieces[i] for i in ids if i not in self.special and i in self.pieces]
        # a piece the SentencePiece model does not know comes back verbatim: its word marks become spaces
        return self.target.decode_pieces(pieces).replace("\u2581", " ").strip()

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def get_vocab_size(self) -> int:
        return self.vocab_size


class SPTokenizer:
    """One SentencePiece model whose ids are the model's ids (T5's spiece.model), eos appended."""

    def __init__(self, path: Path) -> None:
        self.sp = _processor(path)
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else 1
        # SentencePiece says -1 for a token the model does not have
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else None
        self.chat_template: str | None = None
        self.special = {
            i for i in (self.sp.pad_id(), self.sp.eos_id(), self.sp.unk_id(), self.sp.bos_id()) if i >= 0
        }

    def encode(self, text: str) -> list[int]:
        return list(self.sp.encode(text)) + [self.eos_id]

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([i for i in ids if i not in self.special and i < self.sp.get_piece_size()])

    @property
    def vocab_size(self) -> int:
        return int(self.sp.get_piece_size())

    def get_vocab_size(self) -> int:
        return self.vocab_size


class T5SPTokenizer(SPTokenizer):
    """T5's spiece.model plus the special tokens `transformers.T5Tokenizer` adds after the pieces: the
    sentinels `<extra_id_N>` (tokenizer_config.json's `extra_ids`, default 100; `<extra_id_N>` is id
    piece_size + extra_ids - 1 - N) and any other `additional_special_tokens`, in that order.

    Encoding splits the text at special tokens (the sentinels, and the pad / eos / unk pieces written out), as
    T5Tokenizer's added tokens do, and gives each stretch between them to SentencePiece: a stretch starts a
    new word (its own leading "▁") and the whitespace around a special token goes (SentencePiece drops a
    stretch's outer whitespace). Decoding joins the pieces, special tokens as their text unless skipped, with
    "▁" read as a space and the first token's leading space dropped: T5Tokenizer's Metaspace decoder, so that
    " fast" after a sentinel keeps its space ("the cat<extra_id_0> fast")."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder / "spiece.model")
        settings = _read_json(folder / "tokenizer_config.json")
        extra_ids = settings.get("extra_ids", 100)
        listed = settings.get("additional_special_tokens") or []
        if not isinstance(extra_ids, int) or extra_ids < 0 or not isinstance(listed, list):
            raise ValueError(f"{folder / 'tokenizer_config.json'}: extra_ids must be a count and "
                             "additional_special_tokens a list")
        listed = [t["content"] if isinstance(t, dict) else str(t) for t in listed]
        # as T5Tokenizer.from_pretrained: the extra_ids sentinels first (N-1 down to 0), then the listed
        # tokens not among them, in their order (so extra_ids 0 + a listed <extra_id_N> keeps the list's
        # order)
        added = [f"<extra_id_{i}>" for i in reversed(range(extra_ids))]
        added += [t for t in listed if t not in added]
        size = self.sp.get_piece_size()
        self.added: dict[str, int] = {t: size + i for i, t in enumerate(dict.fromkeys(added))}
        self.added_text = {i: t for t, i in self.added.items()}
        # the special tokens: the listed ones, plus every sentinel when the list names none. A sentinel left
        # out of a list that names some (extra_ids larger than the list: no released folder does this) keeps
        # its id but is not split out of the text; T5Tokenizer then matches it as a piece inside a word, qkv
        # does not.
        special = listed if any(t.startswith("<extra_id_") for t in listed) else [*listed, *added]
        self.special |= {self.added[t] for t in special}
        # split points: those and the special pieces (<pad>, </s>, <unk>), longest first
        splits = {
            **{t: self.added[t] for t in special},
            **{self.sp.id_to_piece(i): i for i in self.special if i < size},
        }
        self.splits = splits
        self._split = re.compile(
            "(" + "|".join(re.escape(t) for t in sorted(splits, key=len, reverse=True)) + ")"
        )

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for k, part in enumerate(self._split.split(text)):
            if k % 2:  # a special token's text
                ids.append(self.splits[part])
            elif part:
                ids += self.sp.encode(part)
        return ids + [self.eos_id]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        size, pieces = self.sp.get_piece_size(), []
        for i in ids:
            if skip_special_tokens and i in self.special:
                continue
            if i < size:
                pieces.append(self.sp.id_to_piece(i))
            elif i in self.added_text:
                pieces.append(self.added_text[i])
        text = "".join(pieces).replace("\u2581", " ")
        return text[1:] if pieces and pieces[0].startswith("\u2581") else text

    @property
    def vocab_size(self) -> int:
        return int(self.sp.get_piece_size()) + len(self.added)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def sentencepiece_tokenizer(folder: str | Path) -> Any:
    """The SentencePiece tokenizer of `folder`, or None when it has none. A T5 folder (config.json's
    model_type "t5") also gets T5's sentinels; other spiece.model folders get the bare SentencePiece model."""
    folder = Path(folder)
    if (folder / "source.spm").is_file() and (folder / "vocab.json").is_file():
        return MarianSPTokenizer(folder)
    if (folder / "spiece.model").is_file():
        if _read_json(folder / "config.json").get("model_type") == "t5":
            return T5SPTokenizer(folder)
        return SPTokenizer(folder / "spiece.model")
    return None
