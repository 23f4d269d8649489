"""Reading a request: the JSON body into its model (requests.py), then what needs the served model and the
engine: the prompt's token ids (or the chat template's) and the engine options, checked against the context
and the KV pool. Every check raises APIError with OpenAI's error shape, naming the field, so a bad request
gets a 400 and never reaches the engine."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from qkv.generate.engine import Engine, ImageInput
from qkv.generate.grammar import GrammarError, token_table
from qkv.serve import images, structured
from qkv.serve.config import ServeConfig
from qkv.serve.errors import APIError
from qkv.serve.model import Served
from qkv.serve.requests import (
    FOLDER_SAMPLING,
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)
from qkv.serve.structured import ToolUse
from qkv.serve.tools import renders_tools, template_message, tool_format

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what the context leaves


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


async def read_body(request: Request, limit: int) -> bytes:
    """The request's bytes; a 413 as soon as they are known to pass `limit` (its Content-Length, else the
    bytes received so far), so that an oversized body is never held whole."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body is {size:,} bytes or more, over the limit of {limit:,} "
                    "(--max-request-bytes)", None, "request_too_large")


async def read_json(request: Request, limit: int) -> dict:
    """The request's body as a JSON object; 413 past `limit` bytes, 400 for a body cut short, not JSON, or
    not an object."""
    try:
        raw = await read_body(request, limit)
    except ClientDisconnect:  # nobody to answer; uvicorn would log a traceback for each such client
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        logging.getLogger("uvicorn.error").warning("%s went away before sending its whole request body",
                                                   client)
        raise APIError(400, "the request body was cut short", None, "incomplete_body") from None
    try:
        body = json.loads(raw)
    # JSONDecodeError and UnicodeDecodeError are ValueErrors, as is an integer of over 4300 digits; nesting
    # too deep for the parser is a RecursionError: all of them a malformed body, not a server error
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON ({str(e)[:200]})", None,
                       "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", None, "invalid_json")
    return body


def check_counts(body: dict, most: int) -> None:
    """400 for a chat body of more than `most` messages or content parts, counted before they are validated
    (10^6 one-word messages fit a 50 MB body, and took a minute of the event loop to validate)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return  # parse() says what is wrong
    what = f"{len(messages):,} messages" if len(messages) > most else None
    if what is None:
        parts = sum(len(m["content"]) for m in messages
                    if isinstance(m, dict) and isinstance(m.get("content"), list))
        what = f"{parts:,} content parts" if parts > most else None
    if what is not None:
        raise APIError(400, f"'messages' holds {what}; at most {most:,} are taken (--max-messages)",
                       "messages", "invalid_value")


class RequestChecks:
    """A request body -> the prompt's token ids and the engine options, for one served model and engine."""

    def __init__(self, served: Served, engine: Engine, settings: ServeConfig) -> None:
        self.served, self.engine, self.settings = served, engine, settings
        folder = served.model.generation_defaults()
        # each sampling field: the request's value, else the folder's default, else OpenAI's
        self.sampling_defaults = {k: folder[k] for k in FOLDER_SAMPLING if folder.get(k) is not None}
        self.chat_template = getattr(served.codec.tokenizer, "chat_template", None)
        self.tool_format = tool_format(self.chat_template)  # how this model writes a tool call

    async def body(self, request: Request, chat: bool) -> CompletionRequest | ChatCompletionRequest:
        """The request's body, read and checked: the model's name first (a 404 for another model)."""
        body = await read_json(request, self.settings.max_request_bytes)
        check_text(body)
        model = body.get("model")
        if not isinstance(model, str):
            raise APIError(400, "'model' is required (a string: see GET /v1/models)", "model", "invalid_type")
        if model != self.served.name:
            raise APIError(404, f"the model '{model}' does not exist; this server has '{self.served.name}'",
                           "model", "model_not_found")
        if chat:
            check_counts(body, self.settings.max_messages)
        return parse(body, chat)

    def options(self, body: CompletionRequest | ChatCompletionRequest, prompt_len: int,
                default_max: int | None) -> dict[str, Any]:
        """Engine options of a request (its GenerationConfig's settings), checked against the context and the
        KV pool; 400 for what cannot run."""
        prompt_field = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        ctx = self.engine.context
        if ctx is not None and prompt_len >= ctx:
            raise APIError(400, f"the prompt has {prompt_len} tokens; the model's context is {ctx}",
                           prompt_field, "context_length_exceeded")
        max_tokens = body.max_new_tokens
        given = max_tokens is not None
        if not given:  # the default: at most what the context and the KV pool leave (at least 1)
            max_tokens = default_max if default_max is not None else self.settings.max_tokens_cap
            max_tokens = max(1, min(max_tokens, self.engine.room(prompt_len)))
        try:
            self.engine.check_request(prompt_len, max_tokens)
        except ValueError as e:
            # without max_tokens the request asked for what fits: the prompt alone does not, and is what to
            # change
            raise APIError(400, f"{e}: lower max_tokens or shorten the prompt" if given else
                           f"{e}: the prompt of {prompt_len} tokens alone does not fit; shorten it",
                           body.max_tokens_field if given else prompt_field,
                           "context_length_exceeded") from None
        self._check_choices(body)
        cfg = body.to_generation_config(self.sampling_defaults, max_tokens)
        return {**cfg.explicit(), **body.engine_options()}

    def _check_choices(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """400 for n past the running batch (each choice is a sequence of it), a prompt's log-probabilities
        from a model that cannot give them, and logit_bias ids past the vocabulary."""
        n, most = body.n or 1, self.engine.max_batch_size
        if n > most:
            raise APIError(400, f"'n' must be at most {most} (the server's max_batch_size), got {n}", "n",
                           "invalid_value")
        if body.engine_options().get("prompt_logprobs") is not None and not self.engine.all_logits:
            raise APIError(400, f"'echo' with 'logprobs': {type(self.served.model).__name__} cannot score a "
                           "prompt (its step returns only the last position's logits)", "echo", "unsupported")
        V = self.served.model.output_vocab_size
        bad = [t for t in body.logit_bias_ids or {} if t >= V]
        if bad:
            raise APIError(400, f"'logit_bias' has token ids outside the vocabulary 0..{V - 1}: {bad[:5]}",
                           "logit_bias", "invalid_value")

    def grammar(self, body: CompletionRequest | ChatCompletionRequest) -> str | None:
        """The grammar response_format / tools ask for (serve/structured.py), compiled against the model's
        vocabulary (the engine's: same tokenizer, columns and eos ids); None: unconstrained. Called off the
        event loop: a large schema compiles for milliseconds, a tokenizer's table is read once in ~1 s."""
        wants = body.response_format is not None and body.response_format.type != "text"
        if isinstance(body, ChatCompletionRequest) and body.tools and body.tool_choice != "none":
            wants = True
        if not wants:
            return None
        try:
            table, why = token_table(self.served.codec, self.served.model.output_vocab_size,
                                     self.engine.cfg.eos_ids), None
        except GrammarError as e:  # no Hugging Face tokenizer, no eos: schemas checked without the vocabulary
            table, why = None, e
        grammar = structured.grammar_of(body, self.tool_format, table)
        if grammar is not None and why is not None:
            field = "response_format" if body.response_format is not None else "tool_choice"
            raise APIError(400, f"structured output is not available for this model: {why}", field,
                           "unsupported")
        return grammar

    def tool_use(self, body: CompletionRequest | ChatCompletionRequest) -> ToolUse | None:
        """The request's tools (None: none, or tool_choice "none"); 400 where the chat template cannot show
        them to the model."""
        use = structured.tool_use(body, self.tool_format)
        if use is not None and not renders_tools(self.chat_template):
            raise APIError(400, f"the chat template of '{self.served.name}' does not render tools", "tools",
                           "unsupported")
        return use

    def prompt_ids(self, body: CompletionRequest) -> list[int]:
        """The prompt's ids; a vision-language model's image placeholder is refused (images come as chat
        image_url parts: the placeholders need their image)."""
        ids = self._prompt_ids(body)
        if self.served.images is not None and self.served.model.config.image_token_id in ids:
            raise APIError(400, "'prompt' holds the model's image token: send images as image_url parts of "
                           "/v1/chat/completions", "prompt", "invalid_value")
        return ids

    def _prompt_ids(self, body: CompletionRequest) -> list[int]:
        p = body.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if not p:
                raise APIError(400, "'prompt' is empty", "prompt", "invalid_value")
            ids = self.served.codec.encode(p)
            if not ids:
                raise APIError(400, "'prompt' encodes to no tokens", "prompt", "invalid_value")
            return ids
        if p and all(isinstance(t, int) for t in p):
            V = self.served.model.output_vocab_size
            bad = [t for t in p if not 0 <= t < V]
            if bad:
                raise APIError(400, f"'prompt' has token ids outside the vocabulary 0..{V - 1}: {bad[:5]}",
                               "prompt", "invalid_value")
            return list(p)
        if not p:
            raise APIError(400, "'prompt' is required and must not be empty", "prompt", "invalid_value")
        raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                       "prompt", "invalid_type")

    def chat_ids(self, body: ChatCompletionRequest,
                 tools: ToolUse | None = None) -> tuple[list[int], list[ImageInput] | None]:
        """The chat template's ids of the messages (and of `tools`), and their images for the engine (None:
        no image). A vision-language model's messages go to the template as lists of parts, each image as
        {"type": "image"} (images.py)."""
        vision = self.served.images is not None
        for i, m in enumerate(body.messages):
            if m.images and not vision:
                raise APIError(400, f"messages[{i}]: image parts need a vision-language model; "
                               f"'{self.served.name}' takes text only", f"messages[{i}]", "unsupported")
        if not self.served.codec.has_chat_template:
            raise APIError(400, f"the model '{self.served.name}' has no chat template: use /v1/completions",
                           "messages", "no_chat_template")
        decoded = images.decoded_images(body, self.settings) if vision else []
        inputs = images.image_inputs(decoded, self.served.images) if decoded else None
        messages = images.template_messages(body) if vision else [template_message(m) for m in body.messages]
        try:
            ids = self.served.codec.chat_prompt(messages, **({"tools": tools.tools} if tools else {}))
        except Exception as e:  # a template's own raise_exception (e.g. roles must alternate)
            raise APIError(400, f"the chat template rejected the messages: {e}", "messages",
                           "invalid_value") from None
        if not ids:
            raise APIError(400, "the rendered chat prompt is empty", "messages", "invalid_value")
        if vision:
            ids = images.expand_placeholders(ids, self.served, decoded)
        return ids, inputs
