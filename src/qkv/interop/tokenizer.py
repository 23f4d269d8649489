"""The tokenizer of a Hugging Face model folder: `tokenizer.json` + special tokens + the chat template.

    tok = load_hf_tokenizer("path/to/model")
    ids = tok.encode("Hello", add_special_tokens=True)       # the folder's post-processor adds bos if it says
    so text = tok.apply_chat_template(messages, add_generation_prompt=True)
    ids, mask = tok.apply_chat_template(messages, return_assistant_mask=True)   # mask: 1 = assistant token

What comes from where (the files `transformers` reads, in its order of precedence):
  tokenizer.json           the tokenizer itself, through the Hugging Face `tokenizers` library
  tokenizer_config.json    bos/eos/pad/unk tokens, `chat_template`, add_bos_token / add_eos_token
  special_tokens_map.json  the special tokens of older folders (tokenizer_config.json wins)
  chat_template.jinja      the chat template of newer folders (wins over the tokenizer_config.json field)
  generation_config.json / config.json   more end-of-sequence ids (a chat model often stops on several)

The chat template is untrusted code from a model folder, so it is rendered the way `transformers` renders
it: Jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols extension,
`raise_exception`, a `tojson` that does not HTML-escape, `strftime_now`, and the special tokens
(bos_token, eos_token, ...) as variables. `{% generation %}...{% endgeneration %}` blocks mark what the
assistant says; templates without them get their assistant spans located in the rendered text (below).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from tokenizers import Tokenizer

from qkv.generate.text import StreamDecoder
from qkv.interop.chat_sandbox import LimitedEnvironment, render_limited
from qkv.storage import CheckpointError, read_json_object

# the named special tokens transformers passes to a chat template (its `special_tokens_map`)
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

Message = Mapping[str, Any]


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    """An eos_token_id field: an int, a list of ints, or null."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


# -- the sandboxed template environment -----------------------------------------------------------------
_SPANS: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("qkv_generation_spans",
                                                                                  default=None)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &, '): chat templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}body{% endgeneration %}`: renders body unchanged and, while a render is tracking,
    records where in the output it landed (the assistant's part of the conversation)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller: Any) -> str:
        text = caller()
        tracking = _SPANS.get()
        if tracking is not None:
            # the blocks the template has yielded so far are the output before this one
            blocks, spans = tracking
            start = sum(len(b) for b in blocks)
            spans.append((start, start + len(text)))
        return text


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> Any:
    """The template compiled in the sandbox (cached: a chat renders the same template every turn)."""
    env = LimitedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise CheckpointError(f"the chat template is not valid Jinja2: {e} (line {e.lineno})") from None


def render_chat_template(source: str, messages: Sequence[Message], *, add_generation_prompt: bool = False,
                         track_generation: bool = False, origin: str = "",
                         **variables: Any) -> tuple[str, list[tuple[int, int]]]:
    """Render `source` for `messages` under qkv.interop.chat_sandbox's size and time limits; returns (text,
    character spans of `{% generation %}` blocks). origin: where the template came from, for errors."""
    name = f"chat template{f' of {origin}' if origin else ''}"
    template = compile_chat_template(source)
    # as transformers does: keys whose value is None are dropped, so `message.tool_calls is defined` works
    msgs = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
    kwargs = {"messages": msgs, "add_generation_prompt": add_generation_prompt, "tools": None,
              "documents": None, **variables}
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    token = _SPANS.set((blocks, spans) if track_generation else None)
    try:
        render_limited(template.generate(**kwargs), blocks)
    except jinja2.exceptions.TemplateError as e:  # raise_exception(), a sandbox refusal, a limit, an include
        raise ValueError(f"{name}: {e}") from None
    except (MemoryError, OverflowError, RecursionError) as e:  # past what the limits foresee
        raise ValueError(f"{name}: refused ({type(e).__name__})") from None
    finally:
        _SPANS.reset(token)
    return "".join(blocks), spans


def has_generation_blocks(source: str) -> bool:
    return re.search(r"\{%-?\s*generation\s*-?%\}", source) is not None


class HFTokenizer:
    """A Hugging Face folder's tokenizer (see the module docstring). Build it with `load_hf_tokenizer`."""

    def __init__(self, tokenizer: Any, config: Mapping[str, Any] | None = None,
                 chat_template: str | None = None, extra_eos_ids: Iterable[int] = (),
                 skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer
        # decode()'s default: False as transformers' decode; True where the bare `tokenizers` object's
        # default is what callers expect (find_tokenizer's folders)
        self.skip_special_tokens = skip_special_tokens
        config = dict(config or {})
        self.config = config
        self.chat_template = chat_template
        self.chat_template_origin = ""  # the folder it came from (load_hf_tokenizer), named in render errors
        self.special_tokens: dict[str, str] = {}
        for name in SPECIAL_NAMES:
            text = _token_text(config.get(name))
            if text is not None:
                self.special_tokens[name] = text
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.pad_token = self.special_tokens.get("pad_token")
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.pad_token_id = self.token_to_id(self.pad_token)
        eos = self.token_to_id(self.eos_token)
        self.eos_token_id = eos
        # every id that ends a sequence: the tokenizer's eos and the model's (generation_config.json often
        # lists the chat's end-of-turn token beside the base model's end of text)
        self.eos_token_ids: set[int] = ({eos} if eos is not None else set()) | set(extra_eos_ids)
        # add_bos_token / add_eos_token: Llama-style folders say it here; the post-processor may already do it
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.add_eos_token = bool(config.get("add_eos_token", False))
        self._end_of_turn: frozenset[int] | None = None

    # -- vocabulary ---------------------------------------------------------------------------------------
    @property
    def bos_id(self) -> int | None:
        return self.bos_token_id

    @property
    def eos_id(self) -> int | None:
        return self.eos_token_id

    @property
    def pad_id(self) -> int | None:
        return self.pad_token_id

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
        return self.tokenizer.id_to_token(idx)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    # -- text <-> ids --------------------------------------------------------------------------------------
    def _encode(self, text: str, add_special_tokens: bool) -> Any:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. add_special_tokens: what the folder's post-processor adds (bos for Llama),
        plus bos/eos when tokenizer_config.json asks for them and the post-processor did not add them."""
        return self.encode_with_offsets(text, add_special_tokens)[0]

    def encode_with_offsets(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """encode(), and each token's character range in `text` ((0, 0) for a special token added here)."""
        enc = self._encode(text, add_special_tokens)
        ids, offsets = list(enc.ids), list(enc.offsets)
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
                ids.insert(0, self.bos_token_id)
                offsets.insert(0, (0, 0))
            if self.add_eos_token and self.eos_token_id is not None and ids[-1:] != [self.eos_token_id]:
                ids.append(self.eos_token_id)
                offsets.append((len(text), len(text)))
        return ids, offsets

    def decode(self, ids: Iterable[int], skip_special_tokens: bool | None = None) -> str:
        skip = self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """An incremental decoder for streamed tokens (text is emitted once it is complete UTF-8)."""
        return StreamDecoder(lambda ids: self.decode(ids, skip_special_tokens))

    # -- chat ------------------------------------------------------------------------------------------------
    @property
    def end_of_turn_ids(self) -> frozenset[int]:
        """The ids that end an assistant turn: the eos ids and the special token the chat template writes
        right after an assistant message's content (ChatML's <|im_end|> in a folder whose eos is
        <|endoftext|>), found by rendering a probe conversation once."""
        if self._end_of_turn is None:
            ids = set(self.eos_token_ids)
            probe = "qkv-probe-answer"
            text = ""
            turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}]
            # a template may refuse a conversation without a system message first (raise_exception): then
            # probe with one, rather than miss the end-of-turn token (a model tuned without it never stops)
            for messages in (
                (turn, [{"role": "system", "content": "hi"}, *turn]) if self.chat_template else ()
            ):
                try:
                    text = self.apply_chat_template(messages)
                    break
                except ValueError:
                    continue
            at = text.find(probe)
            if at >= 0:
                after = text[
                    at + len(probe) :
                ].lstrip()  # spaces or a newline before the token (Llama-2: " </s>")
                first = self.encode(after, add_special_tokens=False)[:1] if after else []
                specials = {i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
                if first and first[0] in specials:
                    ids.add(first[0])
            self._end_of_turn = frozenset(ids)
        return self._end_of_turn

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = False,
                    track_generation: bool = False, **variables: Any) -> tuple[str, list[tuple[int, int]]]:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (no chat_template.jinja and no "
                             "`chat_template` in tokenizer_config.json)")
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    track_generation=track_generation, origin=self.chat_template_origin,
                                    **{**self.special_tokens, **variables})

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = False,
                            tokenize: bool = False, return_assistant_mask: bool = False,
                            **variables: Any) -> Any:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the folder's chat template.

        Returns the text (tokenize=False), its token ids (tokenize=True; no special tokens are added beyond
        what the template writes, as transformers does), or with return_assistant_mask=True a pair
        (ids, mask) where mask[i] = 1 for a token overlapping what the assistant says: the template's
        `{% generation %}` blocks when it has them, else each assistant message's content located in the
        rendered text plus an end-of-turn token that follows it (after whitespace at most; `end_of_turn_ids`)
        (so a model fine-tuned on the mask learns to stop). Extra keyword arguments are template variables
        (e.g. enable_thinking=False).
        """
        if not return_assistant_mask:
            text, _ = self.render_chat(messages, add_generation_prompt, **variables)
            return self.encode(text, add_special_tokens=False) if tokenize else text
        generation = has_generation_blocks(self.chat_template or "")
        text, spans = self.render_chat(messages, add_generation_prompt, track_generation=generation,
                                       **variables)
        if not generation:
            spans = self._assistant_spans(text, messages, variables)
        enc = self._encode(text, add_special_tokens=False)
        return list(enc.ids), spans_to_token_mask(spans, enc.offsets)

    def _assistant_spans(self, text: str, messages: Sequence[Message],
                         variables: Mapping[str, Any]) -> list[tuple[int, int]]:
        """Character spans of each assistant message's content in the rendered `text`, found in message order,
        extended over an end-of-turn token that directly follows. An assistant message's content is searched
        from where the render of the messages before it with the generation prompt ends, when that is a prefix
        of `text` (so a short answer, "a", is not found inside the template's own role header), else after the
        previous message's content. Templates that rewrite the content beyond trimming it cannot be
        located."""
        enders = sorted({t for t in (self.id_to_token(i) for i in self.end_of_turn_ids) if t}, key=len,
                        reverse=True)
        spans: list[tuple[int, int]] = []
        cursor = 0
        for i, m in enumerate(messages):
            content = m.get("content")
            if not isinstance(content, str) or not content.strip():
                continue
            if m.get("role") == "assistant" and i > 0:
                try:
                    head, _ = self.render_chat(messages[:i], add_generation_prompt=True, **variables)
                except ValueError:  # a template that refuses the shorter conversation
                    head = ""
                if head and text.startswith(head):
                    cursor = max(cursor, len(head))
            needle = content  # as written, else as a template that trims it writes it
            at = text.find(needle, cursor)
            if at < 0:
                needle = content.strip()
                at = text.find(needle, cursor)
            if m.get("role") != "assistant":
                if at >= 0:  # a system prompt some templates move or drop is simply not found
                    cursor = at + len(needle)
                continue
            if at < 0:
                raise ValueError(f"message {i}: the assistant's content is not in the rendered chat (the "
                                 "template changes it); add {% generation %} blocks to the template")
            end = at + len(needle)
            gap = len(text[end:]) - len(text[end:].lstrip())  # Llama-2 writes content + ' ' + eos
            for ender in enders:
                if text.startswith(ender, end + gap):
                    end += gap + len(ender)
                    break
            spans.append((at, end))
            cursor = end
        return spans


def spans_to_token_mask(spans: Sequence[tuple[int, int]], offsets: Sequence[tuple[int, int]]) -> list[int]:
    """1 for every token whose character range overlaps a span (as transformers computes its assistant mask:
    spans and offsets are both in order, one pass)."""
    mask = [0] * len(offsets)
    s = 0
    for t, (start, end) in enumerate(offsets):
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        if s == len(spans):
            break
        if end > spans[s][0]:
            mask[t] = 1
    return mask


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    field = config.get("chat_template")
    if isinstance(field, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in field if isinstance(t, dict)}
        field = named.get("default")
        if field is None:
            raise CheckpointError(f"{folder}: tokenizer_config.json has named chat templates {sorted(named)} "
                                  "but none called 'default'")
    if field is None:
        legacy = folder / "chat_template.json"  # processor folders
        field = read_json_object(legacy).get("chat_template")
    return field if isinstance(field, str) and field else None


def load_hf_tokenizer(folder: str | Path) -> HFTokenizer:
    """The tokenizer of a Hugging Face model folder (tokenizer.json is required)."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(
            f"{folder}: no tokenizer.json (qkv reads the fast-tokenizer file; a folder with "
            "only tokenizer.model / vocab files can be converted by saving it once with "
            "transformers' AutoTokenizer)"
        )
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a plain Exception for a malformed file
        raise CheckpointError(f"{path}: cannot be read by the tokenizers library ({e})") from None
    config = {
        **read_json_object(folder / "special_tokens_map.json"),
        **read_json_object(folder / "tokenizer_config.json"),
    }
    extra: list[int] = []
    for name in ("generation_config.json", "config.json"):
        extra += _ids(read_json_object(folder / name).get("eos_token_id"))
    tok = HFTokenizer(tokenizer, config, _chat_template(folder, config), extra)
    tok.chat_template_origin = str(folder)
    return tok


def special_tokens_config(folder: Path) -> dict[str, Any]:
    """The named special tokens of a folder's special_tokens_map.json / tokenizer_config.json (the latter
    wins); a file that is missing or unreadable gives none (the tokenizer still encodes without them)."""
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        try:
            config.update(read_json_object(folder / name))
        except CheckpointError:
            continue
    return {k: v for k, v in config.items() if k in SPECIAL_NAMES}


def bare_tokenizer(tokenizer: Any, config: Mapping[str, Any] | None = None) -> HFTokenizer:
    """A `tokenizers.Tokenizer` as its own encode/decode behave: what its post-processor adds and nothing
    more (no add_bos_token / add_eos_token from a config), special tokens skipped when decoding; `config`
    names the special tokens (bos/eos/pad ids)."""
    specials = {k: v for k, v in (config or {}).items() if k in SPECIAL_NAMES}
    return HFTokenizer(tokenizer, specials, skip_special_tokens=True)
