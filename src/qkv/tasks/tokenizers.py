"""Tokenizers: characters, whitespace-separated symbols, and byte-level BPE (Hugging Face `tokenizers`).

Special tokens live here and only here. Every tokenizer puts them first, in this order, so their ids are
the same whatever the task: <pad>=0, <bos>=1, <eos>=2, <sep>=3, <unk>=4, <mask>=5 (the encoder-decoder's
default pad/bos/eos ids). <bos> doubles as BERT's [CLS] (the position the pooler reads).

A tokenizer is saved into a checkpoint folder as `tokenizer.json` (for BPE, Hugging Face's own format)
plus `tokenizer_config.json` ({"kind": "char" | "word" | "bpe"}), so `qkv generate CHECKPOINT` can decode
without the task's data: `save_tokenizer(tok, folder)` / `load_tokenizer(folder)`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from qkv.interop.gguf_model import is_gguf
from qkv.interop.gguf_tokenizer import load_gguf_tokenizer
from qkv.interop.tokenizer import bare_tokenizer, special_tokens_config
from qkv.storage import atomic_write, atomic_write_text
from qkv.tasks.spm import sentencepiece_tokenizer
from qkv.tokenizer import TextTokenizer

SPECIALS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<sep>", "<unk>", "<mask>")
PAD, BOS, EOS, SEP, UNK, MASK = range(len(SPECIALS))

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class TokenizerError(ValueError):
    """A token id outside the vocabulary, a character a strict tokenizer cannot encode, a bad file."""


def _as_list(ids: Any) -> list[int]:
    if hasattr(ids, "tolist"):  # torch tensor / numpy array
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        raise TokenizerError("decode takes one sequence of ids; use decode_batch for a batch")
    return [int(i) for i in ids]


class Tokenizer:
    """Shared interface: ids of the special tokens, encode/decode, save/load (a
    qkv.tokenizer.TextTokenizer)."""

    kind: str = ""
    specials: tuple[str, ...] = SPECIALS
    pad_id, bos_id, eos_id, sep_id, unk_id, mask_id = PAD, BOS, EOS, SEP, UNK, MASK
    chat_template: str | None = None  # a task's vocabulary has no chat format

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def _decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def unknown_symbols(self, text: str) -> list[str]:
        """Symbols of `text` the vocabulary lacks (read as <unk>); none for byte-level tokenizers."""
        return []

    def decode(self, ids: Any, skip_special: bool = True) -> str:
        """ids -> text. Ids outside [0, vocab_size) are an error; specials are dropped unless
        skip_special=False."""
        ids = _as_list(ids)
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        if skip_special:
            ids = [i for i in ids if i >= len(self.specials)]
        return self._decode(ids)

    def decode_batch(self, batch: Any, skip_special: bool = True) -> list[str]:
        if hasattr(batch, "tolist"):
            batch = batch.tolist()
        return [self.decode(row, skip_special) for row in batch]

    def save(self, folder: str | os.PathLike) -> Path:
        raise NotImplementedError


class CharTokenizer(Tokenizer):
    """One token per character. Characters never seen when the vocabulary was built map to <unk>
    (or raise, with strict=True)."""

    kind = "char"
    separator = ""

    def __init__(self, symbols: Iterable[str], strict: bool = False) -> None:
        symbols = list(dict.fromkeys(symbols))  # dedupe, keep order
        clash = [s for s in symbols if s in SPECIALS]
        if clash:
            raise TokenizerError(f"{clash[0]!r} is a special token name and cannot be a symbol")
        self.symbols = symbols
        self.itos: list[str] = list(SPECIALS) + symbols
        self.stoi: dict[str, int] = {s: i for i, s in enumerate(self.itos)}
        self.strict = strict

    @classmethod
    def from_text(cls, text: str | Iterable[str], strict: bool = False) -> CharTokenizer:
        """Vocabulary = the distinct characters of `text` (or of each string in an iterable), sorted."""
        chars: set[str] = set()
        for t in [text] if isinstance(text, str) else text:
            chars.update(t)
        return cls(sorted(chars), strict=strict)

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def split(self, text: str) -> list[str]:
        return list(text)

    def unknown_symbols(self, text: str) -> list[str]:
        """The distinct symbols of `text` this vocabulary lacks (encode reads them as <unk>), in order."""
        return list(dict.fromkeys(s for s in self.split(text) if s not in self.stoi))

    def encode(self, text: str) -> list[int]:
        out = []
        for s in self.split(text):
            i = self.stoi.get(s)
            if i is None:
                if self.strict:
                    raise TokenizerError(f"{s!r} is not in this tokenizer's vocabulary")
                i = self.unk_id
            out.append(i)
        return out

    def _decode(self, ids: list[int]) -> str:
        return self.separator.join(self.itos[i] for i in ids)

    def to_dict(self) -> dict[str, Any]:
        return {"qkv_tokenizer": self.kind, "specials": list(SPECIALS), "symbols": self.symbols}

    def save(self, folder: str | os.PathLike) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        _write_json(folder / TOKENIZER_FILE, self.to_dict())
        _write_json(folder / TOKENIZER_CONFIG_FILE, {"kind": self.kind})
        return folder / TOKENIZER_FILE

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CharTokenizer:
        if list(data.get("specials", [])) != list(SPECIALS):
            raise TokenizerError(
                f"tokenizer file has special tokens {data.get('specials')}, expected {list(SPECIALS)}"
            )
        return cls(data["symbols"])


class WordTokenizer(CharTokenizer):
    """One token per whitespace-separated symbol (ListOps: '[MAX 2 9 ]'); decode joins with spaces."""

    kind = "word"
    separator = " "

    @classmethod
    def from_text(cls, text: str | Iterable[str], strict: bool = False) -> WordTokenizer:
        words: set[str] = set()
        for t in [text] if isinstance(text, str) else text:
            words.update(t.split())
        return cls(sorted(words), strict=strict)

    def split(self, text: str) -> list[str]:
        return text.split()


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style, Sennrich et al. 2016 over bytes), trained with Hugging Face `tokenizers`.
    Every byte is in the base alphabet, so nothing is ever unknown."""

    kind = "bpe"

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        for i, s in enumerate(SPECIALS):
            if self.hf.token_to_id(s) != i:
                raise TokenizerError(f"BPE tokenizer must have special token {s} at id {i}")

    @classmethod
    def train(cls, texts: str | Iterable[str], vocab_size: int = 512, min_frequency: int = 2,
              extra_specials: Sequence[str] = ()) -> BPETokenizer:
        """extra_specials: more special tokens reserved after SPECIALS (a chat format's role markers), each
        read as one token and never merged into others."""
        least = 256 + len(SPECIALS) + len(extra_specials)
        if vocab_size < least:
            raise TokenizerError(
                f"byte-level BPE needs vocab_size >= {least} (256 bytes + specials), got {vocab_size}"
            )
        bpe = tokenizers.ByteLevelBPETokenizer(add_prefix_space=False)
        texts = [texts] if isinstance(texts, str) else list(texts)
        bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=min_frequency,
                                special_tokens=[*SPECIALS, *extra_specials], show_progress=False)
        return cls(bpe._tokenizer)  # the underlying tokenizers.Tokenizer (saves/loads as tokenizer.json)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def _decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=False)

    def save(self, folder: str | os.PathLike) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / TOKENIZER_FILE, self.hf.save)
        _write_json(folder / TOKENIZER_CONFIG_FILE, {"kind": self.kind})
        return folder / TOKENIZER_FILE

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> BPETokenizer:
        try:
            return cls(tokenizers.Tokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises its own Exception type on a bad file
            if isinstance(e, TokenizerError):
                raise
            raise TokenizerError(f"{path}: not a readable tokenizers file ({e})") from None


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_text(json.dumps(obj, ensure_ascii=False, indent=1) + "\n", path)


def save_tokenizer(tokenizer: Tokenizer, folder: str | os.PathLike) -> Path:
    """Write `tokenizer.json` + `tokenizer_config.json` into `folder` (e.g. a checkpoint folder)."""
    return tokenizer.save(folder)


def _read_mapping(path: Path) -> dict[str, Any]:
    """A JSON object file, or a TokenizerError naming it (a damaged run folder)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_tokenizer(folder: str | os.PathLike) -> Tokenizer:
    """Read the tokenizer saved by `save_tokenizer` (a folder, or the tokenizer.json path itself)."""
    p = Path(folder)
    path = p / TOKENIZER_FILE if p.is_dir() else p
    if not path.is_file():
        raise TokenizerError(f"no {TOKENIZER_FILE} in {p}")
    kind = None
    cfg = path.parent / TOKENIZER_CONFIG_FILE
    if cfg.is_file():
        kind = _read_mapping(cfg).get("kind")
    if kind == "bpe":
        return BPETokenizer.from_file(path)
    data = _read_mapping(path)
    kind = kind or data.get("qkv_tokenizer") or ("bpe" if "model" in data else None)
    if kind == "bpe":
        return BPETokenizer.from_file(path)
    if kind in ("char", "word"):
        symbols = data.get("symbols")
        if not isinstance(symbols, list) or not all(isinstance(s, str) for s in symbols):
            raise TokenizerError(f"{path}: a {kind} tokenizer file needs 'symbols', a list of strings")
        return (CharTokenizer if kind == "char" else WordTokenizer).from_dict(data)
    raise TokenizerError(f"{path}: unknown tokenizer kind {kind!r} (expected char, word or bpe)")


def _hf_tokenizer_settings(folder: Path) -> dict[str, Any]:
    """A Hugging Face folder's tokenizer_config.json as a mapping ({} when absent or unreadable)."""
    try:
        data = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def saved_tokenizer(folders: list[Path]) -> Tokenizer | None:
    """The qkv tokenizer saved in the first of `folders` that holds one (a run folder keeps it beside
    task.json), or None; a folder whose tokenizer files are a Hugging Face tokenizer's is passed over."""
    for d in folders:
        if (d / "tokenizer_config.json").is_file():
            try:
                return load_tokenizer(d)
            except Exception:  # noqa: BLE001  (not a qkv tokenizer: the next folder, or the Hugging Face formats)
                pass
    return None


def find_tokenizer(path: str | Path) -> TextTokenizer | None:
    """The tokenizer saved with a checkpoint: a qkv tokenizer (tokenizer_config.json + tokenizer.json, in the
    folder or up to two levels above, e.g. a run folder), else a Hugging Face tokenizer.json or a BERT
    vocab.txt in the folder, or a GGUF file's own (each an HFTokenizer that decodes without special tokens),
    or a SentencePiece one; None when there is none. Each is a qkv.tokenizer.TextTokenizer."""
    folder = Path(path)
    if is_gguf(folder):
        gguf = load_gguf_tokenizer(folder)
        return bare_tokenizer(gguf.tokenizer, gguf.config)
    saved = saved_tokenizer([folder, folder.parent, folder.parent.parent])
    if saved is not None:
        return saved
    if (folder / "tokenizer.json").is_file():
        return bare_tokenizer(
            tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")), special_tokens_config(folder)
        )
    if (folder / "vocab.txt").is_file():
        # as transformers' BertTokenizer: lower case unless the folder's tokenizer_config.json says otherwise
        # (a cased BERT); accents are stripped when lowercasing unless strip_accents says
        settings = _hf_tokenizer_settings(folder)
        lower = settings.get("do_lower_case", True)
        bert = tokenizers.BertWordPieceTokenizer(str(folder / "vocab.txt"), lowercase=bool(lower),
                                                 strip_accents=settings.get("strip_accents"))
        # the tokenizers.Tokenizer inside: its encode and decode, as the wrapper's
        return bare_tokenizer(bert._tokenizer, special_tokens_config(folder))
    # Marian's source.spm / T5's spiece.model, through the sentencepiece package (qkv[seq2seq])
    return sentencepiece_tokenizer(folder)
