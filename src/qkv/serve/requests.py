"""Reading an OpenAI request body: JSON, the model name, the prompt or chat messages, and the sampling
options checked into the engine's settings. Every check raises APIError with OpenAI's error shape, naming the
field, so a bad request gets a 400 and never reaches the engine."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from qkv.generate.config import MIN_TEMPERATURE
from qkv.generate.engine import Engine
from qkv.serve.errors import APIError
from qkv.serve.model import Served

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what the context leaves
# the smallest repetition_penalty accepted: seen tokens' positive logits are divided by it, and 1e-300
# overflowed float32 (inf, then NaN probabilities); at 0.01 a logit of 1e4 becomes 1e6, far from float32's
# 3e38, and a 100x boost of every seen token is already past any useful setting
MIN_REPETITION_PENALTY = 0.01


@dataclass
class ServeSettings:
    max_waiting: int = 64  # queued requests beyond the running batch before 429
    max_tokens_cap: int = 1024  # chat requests without max_tokens: at most this many (and what fits)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_text(body: dict) -> None:
    """400 for a string holding a lone UTF-16 surrogate ("\\ud800" is legal JSON, but no text: the tokenizer
    cannot encode it), naming the field it is in."""
    for name, value in body.items():
        try:
            json.dumps({name: value}, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            bad = e.object[e.start:e.end].encode("unicode_escape").decode("ascii")
            raise APIError(400, f"'{name}' holds a lone surrogate ({bad}), which is not text", name,
                           "invalid_value") from None


def field(body: dict, name: str, check, what: str, default: Any = None) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if not check(v):
        raise APIError(400, f"'{name}' must be {what}, got {json.dumps(v)[:60]}", name, "invalid_type")
    return v


def _range(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise APIError(400, f"'{name}' {message}", name, "invalid_value")


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """400 for OpenAI fields this server does not implement, set to anything but their "off" value: answering
    as if they had been honoured would be worse (a logit_bias or a JSON response_format silently ignored)."""
    off: dict[str, tuple] = {
        "echo": (None, False), "suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []),
        "functions": (None, []), "tool_choice": (None, "none"), "function_call": (None, "none"),
        "top_logprobs": (None, 0),
        # chat's logprobs is a switch; completions' an int, where 0 asks for the sampled token's logprob
        "logprobs": (None, False) if chat else (None,)}
    for name, values in off.items():
        v = body.get(name)
        if not any(v is a or (type(v) is type(a) and v == a) for a in values):
            raise APIError(400, f"'{name}' is not supported by this server", name, "unsupported")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise APIError(400, "'response_format' is not supported by this server (only {\"type\": \"text\"})",
                       "response_format", "unsupported")


# The sampling fields a folder's generation_config.json may set for the requests that leave them out (vLLM's
# --generation-config auto: the same five); OpenAI's values where it does not.
FOLDER_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


class RequestChecks:
    """A request body -> the prompt's token ids and the engine options, for one served model and engine."""

    def __init__(self, served: Served, engine: Engine, settings: ServeSettings) -> None:
        self.served, self.engine, self.settings = served, engine, settings
        folder = served.model.generation_defaults()
        self.sampling_defaults = {**OPENAI_SAMPLING, **{k: folder[k] for k in FOLDER_SAMPLING
                                                         if folder.get(k) is not None}}

    async def body(self, request: Request) -> dict:
        try:
            raw = await request.body()
        except ClientDisconnect:  # nobody to answer; uvicorn would log a traceback for each such client
            client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
            logging.getLogger("uvicorn.error").warning(
                "%s went away before sending its whole request body", client
            )
            raise APIError(400, "the request body was cut short", None, "incomplete_body") from None
        try:
            body = json.loads(raw)
        # JSONDecodeError and UnicodeDecodeError are ValueErrors, as is an integer of over 4300 digits;
        # nesting too deep for the parser is a RecursionError: all of them a malformed body, not a server
        # error
        except (ValueError, RecursionError) as e:
            raise APIError(
                400, f"the request body is not valid JSON ({str(e)[:200]})", None, "invalid_json"
            ) from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", None, "invalid_json")
        check_text(body)
        model = body.get("model")
        if not isinstance(model, str):
            raise APIError(400, "'model' is required (a string: see GET /v1/models)", "model", "invalid_type")
        if model != self.served.name:
            raise APIError(404, f"the model '{model}' does not exist; this server has '{self.served.name}'",
                           "model", "model_not_found")
        return body

    def options(self, body: dict, prompt_len: int, default_max: int | None) -> dict[str, Any]:
        """Engine options of a request, checked; 400 for what cannot run."""
        n = field(body, "n", _is_int, "an integer", 1)
        _range(n == 1, "n", f"must be 1: this server returns one choice per request (got {n})")
        if field(body, "best_of", _is_int, "an integer", 1) != 1:
            raise APIError(400, "'best_of' > 1 is not supported", "best_of", "unsupported")
        _refuse_unsupported(body, "messages" in body)
        for name in ("presence_penalty", "frequency_penalty"):
            v = field(body, name, _is_num, "a number", 0)
            _range(v == 0, name, "is not supported (only 0)")
        # each sampling field: the request's value, else the folder's default, else OpenAI's
        # (sampling_defaults)
        d = self.sampling_defaults
        temperature = field(body, "temperature", _is_num, "a number", d["temperature"])
        _range(0 <= temperature <= 2, "temperature", f"must be in [0, 2], got {temperature}")
        top_p = field(body, "top_p", _is_num, "a number", d["top_p"])
        _range(0 < top_p <= 1, "top_p", f"must be in (0, 1], got {top_p}")
        top_k = field(body, "top_k", _is_int, "an integer", d["top_k"])  # extensions from here, as vLLM's
        _range(top_k >= -1, "top_k", f"must be -1 or 0 (off) or >= 1, got {top_k}")
        min_p = field(body, "min_p", _is_num, "a number", d["min_p"])
        _range(0 <= min_p <= 1, "min_p", f"must be in [0, 1], got {min_p}")
        repetition = field(body, "repetition_penalty", _is_num, "a number", d["repetition_penalty"])
        # bounded below too: seen logits are divided by it, and 1e-300 made them inf (then NaN probabilities)
        _range(MIN_REPETITION_PENALTY <= repetition <= 10, "repetition_penalty",
               f"must be in [{MIN_REPETITION_PENALTY}, 10], got {repetition}")
        seed = field(body, "seed", _is_int, "an integer")
        _range(seed is None or -(2 ** 63) <= seed < 2 ** 64, "seed", f"must be a 64-bit integer, got {seed}")
        stop = field(body, "stop", lambda v: isinstance(v, str) or (isinstance(v, list) and all(
            isinstance(s, str) for s in v)), "a string or a list of strings")
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        _range(len(stop) <= 4 and all(stop), "stop", "takes at most 4 non-empty strings")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = field(body, name, _is_int, "an integer")
        _range(max_tokens is None or max_tokens > 0, name, f"must be > 0, got {max_tokens}")
        ctx = self.engine.context
        if ctx is not None and prompt_len >= ctx:
            raise APIError(400, f"the prompt has {prompt_len} tokens; the model's context is {ctx}",
                           "messages" if "messages" in body else "prompt", "context_length_exceeded")
        given = max_tokens is not None
        if not given:  # the default: at most what the context and the KV pool leave (at least 1)
            max_tokens = default_max if default_max is not None else self.settings.max_tokens_cap
            max_tokens = max(1, min(max_tokens, self.engine.room(prompt_len)))
        try:
            self.engine.check_request(prompt_len, max_tokens)
        except ValueError as e:
            # without max_tokens the request asked for what fits: the prompt alone does not, and is what to
            # change
            prompt_field = "messages" if "messages" in body else "prompt"
            raise APIError(400, f"{e}: lower max_tokens or shorten the prompt" if given else
                           f"{e}: the prompt of {prompt_len} tokens alone does not fit; shorten it",
                           name if given else prompt_field, "context_length_exceeded") from None
        # every setting explicit, "off" included: the engine applies a request's options over its own base
        # config (build_engine: the folder's token ids only), and an option left out would keep that base's
        # value
        opts: dict[str, Any] = {
            "max_new_tokens": max_tokens,
            "seed": seed,
            # below: greedy, the limit (GenerationConfig.sampling)
            "do_sample": temperature >= MIN_TEMPERATURE,
            "temperature": float(temperature),
            "top_p": float(top_p),
            "top_k": max(top_k, 0),
            "min_p": float(min_p),
            "repetition_penalty": float(repetition),
        }
        if stop:
            opts["stop_strings"] = stop
        return opts

    def prompt_ids(self, body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if not p:
                raise APIError(400, "'prompt' is empty", "prompt", "invalid_value")
            ids = self.served.codec.encode(p)
            if not ids:
                raise APIError(400, "'prompt' encodes to no tokens", "prompt", "invalid_value")
            return ids
        if isinstance(p, list) and p and all(_is_int(t) for t in p):
            V = self.served.model.output_vocab_size
            bad = [t for t in p if not 0 <= t < V]
            _range(not bad, "prompt", f"has token ids outside the vocabulary 0..{V - 1}: {bad[:5]}")
            return list(p)
        if p is None or p == [] or p == "":
            raise APIError(400, "'prompt' is required and must not be empty", "prompt", "invalid_value")
        raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                       "prompt", "invalid_type")

    def chat_ids(self, body: dict) -> list[int]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise APIError(400, "'messages' must be a non-empty list", "messages", "invalid_value")
        clean = []
        for i, m in enumerate(msgs):
            content = m.get("content") if isinstance(m, dict) else None
            # OpenAI's content parts: text ones joined (as vLLM), others refused
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise APIError(
                        400,
                        f'messages[{i}].content: only text parts ({{"type": "text", "text": '
                        "...}) are supported by this server",
                        f"messages[{i}]",
                        "unsupported",
                    )
                content = "\n".join(p["text"] for p in content)
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(content, str)):
                raise APIError(
                    400,
                    f"messages[{i}] must be an object with string 'role' and 'content' (a string "
                    "or a list of text parts)",
                    f"messages[{i}]",
                    "invalid_type",
                )
            clean.append({"role": m["role"], "content": content})
        if not self.served.codec.has_chat_template:
            raise APIError(400, f"the model '{self.served.name}' has no chat template: use /v1/completions",
                           "messages", "no_chat_template")
        try:
            ids = self.served.codec.chat_prompt(clean)
        except Exception as e:  # a template's own raise_exception (e.g. roles must alternate)
            raise APIError(
                400, f"the chat template rejected the messages: {e}", "messages", "invalid_value"
            ) from None
        if not ids:
            raise APIError(400, "the rendered chat prompt is empty", "messages", "invalid_value")
        return ids


def stream_settings(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage) of a request, checked."""
    stream = field(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    so = field(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    if body.get("stream_options") is not None and not stream:  # as OpenAI and vLLM answer it
        raise APIError(400, "'stream_options' is only allowed with 'stream': true", "stream_options",
                       "invalid_value")
    include_usage = so.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):  # "no" is not false
        raise APIError(400, f"'stream_options.include_usage' must be a boolean, got "
                       f"{json.dumps(include_usage)[:60]}", "stream_options", "invalid_type")
    return stream, bool(include_usage)
