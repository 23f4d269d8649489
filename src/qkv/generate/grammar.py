"""Structured generation: only the tokens a grammar allows next, by llguidance's matcher.

    grammar = json_schema_grammar({"type": "object", "properties": {...}})   # or a Lark grammar's text
    generate(model, ids, grammar=grammar, tokenizer=hf_tokenizer)   # every output parses as the grammar says
    Engine(model, tokenizer=...).add_request(ids, grammar=grammar)

GenerationConfig.grammar holds the grammar as text (llguidance's Lark syntax, a JSON schema inline with
`%json {...}`, or the JSON grammar json_schema_grammar returns); processors.GrammarMask applies it, one
matcher per row, advanced by the tokens generated since its last call. The matcher walks the tokenizer's own
vocabulary (token_table: the Hugging Face tokenizer.json, read once per tokenizer), so a token spanning a
grammar boundary (`"}` in one token) is allowed exactly when its bytes fit.

Why llguidance (docs/serving.md, "Structured outputs", has the figures of benchmarks/structured.py): on a
32000-token vocabulary its mask costs about 10 µs a token on a CPU where the answer is structure (more inside
strings, where nearly every token is allowed), as xgrammar's, and it does no ahead-of-time work (about 1 ms
before the first token, where xgrammar compiles for tens of milliseconds and outlines-core builds a token
index for 0.6-1.4 s, 28-67 s for any JSON object); it supports JSON schema, Lark and regex in one engine; and
its wheel depends on nothing (xgrammar's requires torch and pulls triton, a GPU compiler).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import llguidance
import numpy as np

# compact JSON (", " and ": " between items, no free whitespace): a model may otherwise spend its tokens on
# whitespace the grammar allows, and a random one does
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A grammar (or JSON schema) llguidance cannot compile; the message says why."""


def json_schema_grammar(schema: dict[str, Any] | None) -> str:
    """The grammar of a JSON value valid against `schema` (None: any JSON object, OpenAI's json_object)."""
    schema = {"type": "object"} if schema is None else schema
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema is a JSON object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(str(e)) from None


def schema_file_grammar(path: str | Path) -> str:
    """The grammar of a JSON schema file (`qkv generate --json-schema`), checked before any model loads;
    GrammarError naming the file when it is no schema llguidance compiles."""
    schema = read_schema(path)
    try:
        grammar = json_schema_grammar(schema)
        check_grammar(grammar)
    except GrammarError as e:
        raise GrammarError(f"{path}: not a JSON schema the grammar engine compiles: {e}") from None
    return grammar


def read_schema(path: str | Path) -> dict[str, Any]:
    """A JSON schema file; GrammarError naming the file when it is none."""
    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise GrammarError(f"cannot read the JSON schema {path}: {e.strerror}") from None
    except (ValueError, RecursionError) as e:
        raise GrammarError(f"{path} is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError(f"{path}: a JSON schema is a JSON object, got {type(schema).__name__}")
    return schema


def lark_json(schema: dict[str, Any]) -> str:
    """`%json {...}`: a JSON value valid against `schema`, as a piece of a Lark grammar (tool calls: the
    arguments between a template's tags), compact as json_schema_grammar's."""
    schema = copy.deepcopy(schema)
    schema.setdefault("x-guidance", JSON_OPTIONS)
    return "%json " + json.dumps(schema)


def lark_string(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text)


def _tokenizers_json(tokenizer: Any) -> str:
    """The `tokenizers` JSON of a tokenizer: a tokenizers.Tokenizer, or an object holding one (qkv's
    HFTokenizer, the server's TextCodec) under `.tokenizer`."""
    t = tokenizer
    for _ in range(4):
        if hasattr(t, "to_str"):
            return t.to_str()
        t = getattr(t, "tokenizer", None)
    raise GrammarError("structured generation needs a Hugging Face tokenizer (tokenizer.json): the grammar "
                       f"is matched against its vocabulary; got {type(tokenizer).__name__}")


# tokenizer object id -> (the object, vocab size, eos ids, its LLTokenizer): reading a 150k vocabulary takes
# ~1 s, so once per tokenizer, not per request (the object is kept so that its id stays its own)
_TABLES: dict[int, tuple[Any, int, tuple[int, ...], llguidance.LLTokenizer]] = {}


def token_table(tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the tokenizer: every token's bytes, `vocab_size` columns (the model's, which
    may be larger than the tokenizer's), the ids that end a sequence (allowed where the grammar is done)."""
    key = (vocab_size, tuple(sorted(eos_ids)))
    hit = _TABLES.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer and hit[1:3] == key:
        return hit[3]
    if not eos_ids:
        raise GrammarError("structured generation needs an end-of-sequence token (the grammar's end is where "
                           "the output stops), and this model has none")
    table = llguidance.LLTokenizer(_tokenizers_json(tokenizer), n_vocab=vocab_size, eos_token=list(key[1]))
    _TABLES[id(tokenizer)] = (tokenizer, *key, table)
    return table


def check_grammar(grammar: str, table: llguidance.LLTokenizer | None = None) -> None:
    """GrammarError naming what llguidance cannot compile in `grammar`."""
    message = llguidance.LLMatcher.validate_grammar(grammar, table)
    if message:
        raise GrammarError(message)


class Matcher:
    """One sequence's place in the grammar: tokens consumed so far, the mask of the next."""

    def __init__(self, table: llguidance.LLTokenizer, grammar: str) -> None:
        self.matcher = llguidance.LLMatcher(table, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.eos = list(table.eos_tokens)

    def consume(self, tokens: list[int]) -> None:
        """Advance over `tokens`, which the mask allowed (RuntimeError otherwise: not this grammar's
        sequence). Once the grammar is done (its eos taken, or nothing more can follow) the rest is
        ignored: a finished row of a batch is padded."""
        if tokens and not self.matcher.is_stopped() and not self.matcher.consume_tokens(tokens):
            raise RuntimeError(f"the grammar rejected the generated tokens: {self.matcher.get_error()}")

    def banned(self, width: int) -> np.ndarray:
        """(width,) bool: the tokens the grammar does not allow next (columns past the tokenizer's: all);
        once it is done, every one but the end of the sequence. numpy: one single-threaded pass each, where
        torch's ops on a loaded CPU wait for their thread pool."""
        if self.matcher.is_stopped():
            out = np.ones(width, dtype=np.bool_)
            out[[t for t in self.eos if t < width]] = False
            return out
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        out = np.ones(width, dtype=np.bool_)
        n = min(width, bits.size)
        np.equal(bits[:n], 0, out=out[:n])
        return out
