"""A model's tokenizer as Hugging Face tokenizer files, beside an exported model (qkv export).

A Hugging Face folder's tokenizer files are copied as they are. A qkv run's tokenizer (qkv.tasks.tokenizers)
is written as the tokenizer.json + tokenizer_config.json that transformers' AutoTokenizer reads:
  - byte-level BPE: its tokenizer.json is already Hugging Face's own; only tokenizer_config.json is new;
  - char / word: a WordLevel vocabulary (the specials first, at qkv's ids), a pre-tokenizer that splits as
    qkv does (every code point; or runs of what Python's str.split() calls whitespace, listed exactly, since
    Rust's whitespace lacks U+001C..U+001F) and a decoder that joins as qkv does ("" for char: Fuse; " " for
    word: the tokenizers default, no decoder).
qkv's char and word tokenizers never read a special token's name out of the text ("<bos>" typed in a prompt
is five characters): their tokenizer_config.json sets split_special_tokens (the BPE one, through tokenizers,
does read it as the special token, and so does transformers). qkv adds no bos/eos when encoding, so there is
no post-processor either.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

from qkv.storage import atomic_write, atomic_write_json

# the files of a Hugging Face folder that describe its tokenizer and generation: copied to OUT unchanged
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "added_tokens.json", "generation_config.json")
# qkv's special tokens under the names transformers gives them
SPECIAL_ROLES = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "sep_token": "<sep>",
                 "unk_token": "<unk>", "mask_token": "<mask>"}


def copy_tokenizer_files(source: Path, out: Path) -> list[str]:
    """Copy a Hugging Face folder's tokenizer and generation files into `out`; the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        # never a file onto itself (OUT = the source is refused; this guards any other alias of it)
        if (source / name).is_file() and not ((out / name).exists() and (out / name).samefile(source / name)):
            shutil.copyfile(source / name, out / name)
            copied.append(name)
    return copied


def _python_whitespace() -> str:
    """A regex class of exactly the characters str.split() splits on (str.isspace())."""
    chars = "".join(f"\\x{{{c:x}}}" for c in range(0x110000) if chr(c).isspace())
    return f"[{chars}]+"


def word_level_tokenizer(tok: Any) -> Any:
    """A tokenizers.Tokenizer that encodes and decodes as qkv's CharTokenizer / WordTokenizer `tok`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {s: i for i, s in enumerate(tok.itos)}
    hf = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_ROLES["unk_token"]))
    if tok.kind == "char":  # Python's list(text): one piece per code point, newlines included
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        hf.decoder = decoders.Fuse()
    else:
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(_python_whitespace()), behavior="removed")
    hf.add_special_tokens(list(tok.specials))  # already in the vocabulary: marked special, ids unchanged
    return hf


def tokenizer_config(context_length: int | None, split_specials: bool) -> dict[str, Any]:
    """tokenizer_config.json of a qkv tokenizer written as a Hugging Face one."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", **SPECIAL_ROLES,
            "split_special_tokens": split_specials, "clean_up_tokenization_spaces": False,
            "add_bos_token": False, "add_eos_token": False,
            **({"model_max_length": context_length} if context_length else {})}


def write_qkv_tokenizer(tok: Any, out: Path, context_length: int | None) -> str | None:
    """`tok` (a qkv tokenizer) as Hugging Face files in `out`; its kind, or None (with a warning) for a kind
    no tokenizer.json expresses exactly."""
    if tok.kind in ("char", "word"):
        hf = word_level_tokenizer(tok)
        atomic_write(out / "tokenizer.json", hf.save)
    elif tok.kind == "bpe":
        atomic_write(out / "tokenizer.json", tok.hf.save)
    else:
        warnings.warn(f"the model's {tok.kind!r} tokenizer has no exact Hugging Face form: OUT has no "
                      "tokenizer", stacklevel=2)
        return None
    atomic_write_json(tokenizer_config(context_length, tok.kind != "bpe"), out / "tokenizer_config.json")
    return tok.kind


def qkv_tokenizer_of(folders: list[Path]) -> Any:
    """The qkv tokenizer saved in the first of `folders` that has one (a run folder keeps it beside
    task.json), or None."""
    from qkv.tasks.tokenizers import TokenizerError, load_tokenizer

    for d in folders:
        if (d / "tokenizer.json").is_file() and (d / "tokenizer_config.json").is_file():
            try:
                return load_tokenizer(d)
            except TokenizerError:  # a Hugging Face tokenizer_config.json (no qkv "kind")
                return None
    return None


__all__ = ["SPECIAL_ROLES", "TOKENIZER_FILES", "copy_tokenizer_files", "qkv_tokenizer_of", "tokenizer_config",
           "word_level_tokenizer", "write_qkv_tokenizer"]
