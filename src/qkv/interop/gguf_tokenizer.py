"""The tokenizer of a GGUF file, built as a Hugging Face `tokenizers.Tokenizer` and wrapped in the HFTokenizer
qkv uses for model folders (special tokens, chat template, end-of-turn ids).

A GGUF file has no tokenizer.json: llama.cpp stores the vocabulary as metadata, and the tokenizer is
rebuilt from it the way transformers rebuilds it for `AutoTokenizer.from_pretrained(..., gguf_file=...)`
(the reference of tests/interop/test_gguf.py):
  tokenizer.ggml.model "gpt2"   byte-level BPE: tokens + merges; the pre-tokenizer's split regex is chosen by
                                tokenizer.ggml.pre (llama-bpe, qwen2, ...; GPT-2's own regex otherwise);
  tokenizer.ggml.model "llama"  SentencePiece BPE with byte fallback: tokens + scores; the merges (rarely
                                stored) are recovered from the scores, best first, as SentencePiece merges;
                                Metaspace "▁" with a prefix space on the first word only;
  token types                   CONTROL tokens become special added tokens (kept whole, skipped in decoding),
                                USER_DEFINED ones plain added tokens (kept whole);
  ids and flags                 bos/eos/unk/pad ids, add_bos_token (a "llama" vocabulary adds bos unless the
                                file says not to), the end-of-turn ids (eot/eom), tokenizer.chat_template.
"""

from __future__ import annotations

import os
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from qkv.interop.gguf_model import GGUFFile
from qkv.interop.tokenizer import HFTokenizer
from qkv.storage import CheckpointError

CONTROL, USER_DEFINED = 3, 4

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regex its merges were learned with (llama.cpp's llm_tokenizer_bpe presets)
SPLITS = {
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3,
    "falcon3": _LLAMA3,
    "pixtral": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "megrez": _QWEN2,
    "tekken": _TEKKEN,
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE vocabularies are spelled in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a piece into two pieces of the
    vocabulary, best piece score first (transformers' generate_merges, the order SentencePiece merges in)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str, float]] = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _byte_level(meta: dict[str, Any]) -> Any:
    alphabet = set(_bytes_to_unicode().values())
    spell = _bytes_to_unicode()
    tokens = [t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))
              for t in meta["tokenizer.ggml.tokens"]]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or ()]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                               byte_fallback=False))
    split = SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: dict[str, Any]) -> Any:
    tokens = list(meta["tokenizer.ggml.tokens"])
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise CheckpointError(
                "a 'llama' (SentencePiece) vocabulary needs tokenizer.ggml.scores or merges"
            )
        merges = sentencepiece_merges(tokens, list(scores))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=True,
                               byte_fallback=True, unk_token=None if unk is None else tokens[int(unk)]))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    return tok


BUILDERS = {"gpt2": _byte_level, "llama": _sentencepiece}


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """The `tokenizers.Tokenizer` a GGUF file's metadata describes (special tokens added, bos
    post-processor)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in BUILDERS:
        raise CheckpointError(
            f"GGUF tokenizer model {kind!r} is not supported; supported: {sorted(BUILDERS)}"
        )
    if not meta.get("tokenizer.ggml.tokens"):
        raise CheckpointError("the GGUF file has no tokenizer.ggml.tokens")
    tok = BUILDERS[kind](meta)
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta.get("tokenizer.ggml.token_type") or ())
    # a control token spelled outside the byte alphabet in a byte-level vocabulary is a llama.cpp mislabel,
    # not a token the model has (transformers skips it too)
    alphabet = set(_bytes_to_unicode().values()) if kind == "gpt2" else None
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
                            if k == CONTROL and (alphabet is None or set(t) <= alphabet)])
    vocab = tok.get_vocab()
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
                    if k == USER_DEFINED and t in vocab])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if add_bos(meta) and bos is not None:
        b = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(single=f"{b} $A", pair=f"{b} $A {b} $B",
                                                           special_tokens=[(b, int(bos))])
    return tok


def add_bos(meta: dict[str, Any]) -> bool:
    """Whether encoding adds bos: the file's flag; a SentencePiece vocabulary without one adds it
    (llama.cpp)."""
    flag = meta.get("tokenizer.ggml.add_bos_token")
    return bool(flag) if flag is not None else meta.get("tokenizer.ggml.model") == "llama"


def load_gguf_tokenizer(path: str | os.PathLike, file: GGUFFile | None = None) -> HFTokenizer:
    """The tokenizer and chat template of a GGUF file, as qkv's HFTokenizer."""
    f = file or GGUFFile(path)
    meta = f.meta
    try:
        tok = build_tokenizer(meta)
    except CheckpointError as e:
        raise CheckpointError(f"{f.path}: {e}") from None
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {"add_bos_token": add_bos(meta),
                              "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        if idx is not None and 0 <= int(idx) < len(tokens):
            config[f"{name}_token"] = tokens[int(idx)]
    # chat models end a turn on a token of their own beside eos (Llama 3's <|eot_id|>, <|eom_id|>)
    extra = [
        int(meta[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta
    ]
    template = meta.get("tokenizer.chat_template")
    return HFTokenizer(tok, config, template if isinstance(template, str) and template else None, extra)


__all__ = ["build_tokenizer", "load_gguf_tokenizer", "sentencepiece_merges"]
