"""A qkv task's tokenizer (qkv.tasks.tokenizers) written as the tokenizer.json + tokenizer_config.json that
transformers' AutoTokenizer reads, beside an exported model (qkv export):
  - byte-level BPE: its tokenizer.json is already Hugging Face's own; only tokenizer_config.json is new;
  - char / word: a WordLevel vocabulary (the specials first, at qkv's ids), a pre-tokenizer that splits as
    qkv does (every code point; or runs of what Python's str.split() calls whitespace, listed exactly, since
    Rust's whitespace lacks U+001C..U+001F) and a decoder that joins as qkv does ("" for char: Fuse; " " for
    word: the tokenizers default, no decoder).
qkv's char and word tokenizers never read a special token's name out of the text ("<bos>" typed in a prompt
is five characters): their tokenizer_config.json sets split_special_tokens (the BPE one, through tokenizers,
does read it as the special token, and so does transformers). qkv adds no bos/eos when encoding, so there is
no post-processor either, except for a run whose task puts <bos> first (ListOps for a classifier that reads
the first position, as BERT's [CLS]): a TemplateProcessing "<bos> $A" then does the same.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from qkv.storage import atomic_write, atomic_write_json
from qkv.tasks.tokenizers import SPECIALS

# qkv's special tokens under the names transformers gives them (SPECIALS: pad, bos, eos, sep, unk, mask)
SPECIAL_ROLES = dict(zip(("pad_token", "bos_token", "eos_token", "sep_token", "unk_token", "mask_token"),
                         SPECIALS, strict=True))


@functools.cache
def _python_whitespace() -> str:
    """A regex class of exactly the characters str.split() splits on (str.isspace())."""
    chars = "".join(f"\\x{{{c:x}}}" for c in range(0x110000) if chr(c).isspace())
    return f"[{chars}]+"


def word_level_tokenizer(tok: Any) -> Any:
    """A tokenizers.Tokenizer that encodes and decodes as qkv's CharTokenizer / WordTokenizer `tok`."""
    vocab = {s: i for i, s in enumerate(tok.itos)}
    hf = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_ROLES["unk_token"]))
    if tok.kind == "char":  # Python's list(text): one piece per code point, newlines included
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        hf.decoder = decoders.Fuse()
    else:
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(_python_whitespace()), behavior="removed")
    hf.add_special_tokens(list(tok.specials))  # already in the vocabulary: marked special, ids unchanged
    return hf


def with_bos(hf: Any, bos: str, bos_id: int) -> Any:
    """A copy of `hf` (a tokenizers.Tokenizer) putting `bos` before every text it encodes, after whatever its
    own post-processor does: what a task that prepends <bos> (as BERT's [CLS], for a classifier reading the
    first position) feeds the model."""
    hf = Tokenizer.from_str(hf.to_str())  # the caller's tokenizer keeps encoding as it did
    template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                             special_tokens=[(bos, bos_id)])
    own = hf.post_processor  # a byte-level BPE's offset trimming, say: kept, before the template
    hf.post_processor = template if own is None else processors.Sequence([own, template])
    return hf


def tokenizer_config(context_length: int | None, split_specials: bool,
                     add_bos: bool = False) -> dict[str, Any]:
    """tokenizer_config.json of a qkv tokenizer written as a Hugging Face one."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", **SPECIAL_ROLES,
            "split_special_tokens": split_specials, "clean_up_tokenization_spaces": False,
            "add_bos_token": add_bos, "add_eos_token": False,
            **({"model_max_length": context_length} if context_length else {})}


def write_qkv_tokenizer(tok: Any, out: Path, context_length: int | None,
                        prepend_bos: bool = False) -> str | None:
    """`tok` (a qkv tokenizer) as Hugging Face files in `out`, putting <bos> first when `prepend_bos` (the
    run's task does); its kind, or None (with a warning) for a kind no tokenizer.json expresses exactly."""
    if tok.kind in ("char", "word"):
        hf = word_level_tokenizer(tok)
    elif tok.kind == "bpe":
        hf = tok.hf
    else:
        warnings.warn(f"the model's {tok.kind!r} tokenizer has no exact Hugging Face form: OUT has no "
                      "tokenizer", stacklevel=2)
        return None
    if prepend_bos:
        hf = with_bos(hf, SPECIAL_ROLES["bos_token"], tok.bos_id)
    atomic_write(out / "tokenizer.json", hf.save)
    atomic_write_json(tokenizer_config(context_length, tok.kind != "bpe", prepend_bos),
                      out / "tokenizer_config.json")
    return tok.kind


__all__ = ["SPECIAL_ROLES", "tokenizer_config", "with_bos", "word_level_tokenizer", "write_qkv_tokenizer"]
