"""The OpenAI request bodies as pydantic models: CompletionRequest (/v1/completions) and ChatCompletionRequest
(/v1/chat/completions), each with to_generation_config().

The sampling fields' numeric bounds are not written here: each is GenerationConfig's field metadata
(generate/config.py, the declaration `qkv generate`'s flags read too), with OpenAI's conventions put over it
where the API differs (OPENAI_RULES, listed in docs/serving.md). A body that breaks a rule is an APIError
(400, OpenAI's error shape) naming the field (parse()); fields the models do not name are accepted and ignored
(clients send "user", "metadata", ...), except OpenAI features this server does not implement (UNSUPPORTED).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from qkv.config import bounds_text, field_types
from qkv.generate.config import (
    LOGIT_BIAS_LIMIT,
    MAX_TOP_LOGPROBS,
    MIN_TEMPERATURE,
    REQUEST_AT_LEAST,
    GenerationConfig,
)
from qkv.serve.errors import APIError

# the smallest repetition_penalty accepted: seen tokens' positive logits are divided by it, and 1e-300
# overflowed float32 (inf, then NaN probabilities); at 0.01 a logit of 1e4 becomes 1e6, far from float32's
# 3e38, and a 100x boost of every seen token is already past any useful setting
MIN_REPETITION_PENALTY = 0.01
_GC = {f.name: f for f in dataclasses.fields(GenerationConfig)}

# Where the API's rule differs from GenerationConfig's, per GenerationConfig field: the bounds that replace
# its own (a lower bound replaces its lower bound, an upper its upper) and what a boundary value means.
OPENAI_RULES: dict[str, dict[str, Any]] = {
    "temperature": {"le": 2},  # OpenAI's upper bound; below MIN_TEMPERATURE greedy, as GenerationConfig's
    "top_k": {"ge": -1, "note": "-1 or 0 = off"},  # vLLM's extension: -1 is its "off"
    "max_new_tokens": {"ge": REQUEST_AT_LEAST["max_new_tokens"]},  # asked to generate nothing: a mistake
    # a server guard on top of GenerationConfig's > 0 (MIN_REPETITION_PENALTY); 10 is vLLM's upper bound
    "repetition_penalty": {"ge": MIN_REPETITION_PENALTY, "le": 10},
    # GenerationConfig takes any int; torch's generators take a 64-bit seed, signed or not
    "seed": {"ge": -(2 ** 63), "le": 2 ** 64 - 1},
    # n: choices of one request, each a sequence in the running batch (checks.py: at most max_batch_size)
    "num_return_sequences": {"le": 128},
    # drafted tokens per decoding step (engine_speculation.py): EngineConfig.speculative_tokens' bound
    "prompt_lookup_num_tokens": {"le": 64},
}


def api_bounds(name: str) -> dict[str, Any]:
    """GenerationConfig.<name>'s metadata with OPENAI_RULES' bounds over it (a lower bound replaces its lower
    bound)."""
    rule = OPENAI_RULES.get(name, {})
    low = {"ge": None, "gt": None} if "ge" in rule or "gt" in rule else {}
    return {**_GC[name].metadata, **low, **rule}


def describe(name: str) -> str:
    """A GenerationConfig field's API bounds in words (GenerationConfig's own wording: bounds_text)."""
    return bounds_text(api_bounds(name))


def setting(name: str) -> Any:
    """The pydantic field of the API setting that is GenerationConfig.<name>: its help text and bounds (and
    the name, SETTING_OF's)."""
    b = api_bounds(name)
    return Field(None, description=_GC[name].metadata["help"], json_schema_extra={"setting": name},
                 **{k: b[k] for k in ("ge", "gt", "le", "lt") if b[k] is not None})


# OpenAI fields this server does not implement, and their "off" values (a value, or a type's): set to
# anything else they are refused, since answering as if they had been honoured would be worse (a logit_bias
# or a JSON response_format silently ignored)
UNSUPPORTED: dict[str, tuple] = {
    "suffix": (None, ""), "functions": (None, []), "function_call": (None, "none")}
# The sampling fields a folder's generation_config.json may set for the requests that leave them out (vLLM's
# --generation-config auto: the same five); OpenAI's values where it does not.
FOLDER_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool | None = None


class JSONSchemaFormat(BaseModel):
    """response_format's json_schema: the schema every output validates against (strict or not: the grammar
    is the schema, so the output always validates)."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _Body(BaseModel):
    """What both endpoints take: the model, the sampling settings, stop strings, streaming."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    model: str
    temperature: float | None = setting("temperature")
    top_p: float | None = setting("top_p")
    top_k: int | None = setting("top_k")  # an extension from here on, as vLLM's
    min_p: float | None = setting("min_p")
    repetition_penalty: float | None = setting("repetition_penalty")
    seed: int | None = setting("seed")
    max_tokens: int | None = setting("max_new_tokens")
    max_completion_tokens: int | None = setting("max_new_tokens")
    n: int | None = setting("num_return_sequences")
    best_of: int | None = setting("num_return_sequences")
    presence_penalty: float | None = setting("presence_penalty")
    frequency_penalty: float | None = setting("frequency_penalty")
    # this request's speculative decoding by prompt lookup (an extension; the server's --speculative: every
    # request's)
    prompt_lookup_num_tokens: int | None = setting("prompt_lookup_num_tokens")
    logit_bias: dict[str, float] | None = None  # token id (JSON keys are strings) -> bias (check_supported)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None  # structured output (serve/structured.py)

    def check_supported(self, chat: bool = False) -> None:
        """400 for what this server does not do (best_of, OpenAI's UNSUPPORTED features, tools on
        completions), logit_bias that is not token id -> bias, a json_schema response_format without its
        schema, stop strings past OpenAI's four, stream_options without a stream."""
        if self.best_of not in (None, 1):
            raise APIError(400, "'best_of' > 1 is not supported (ask for n choices)", "best_of",
                           "unsupported")
        extra = self.model_extra or {}
        # chat has no echo; completions list alternatives with logprobs=N, not chat's top_logprobs
        off = {**UNSUPPORTED, **({"echo": (None, False)} if chat else {"top_logprobs": (None, 0)})}
        for name, values in off.items():
            v = extra.get(name)
            if not any(v is a or (type(v) is type(a) and v == a) for a in values):
                raise APIError(400, f"'{name}' is not supported by this server", name, "unsupported")
        for name in ("tools", "tool_choice"):  # chat's (ChatCompletionRequest's fields, never in its extra)
            if extra.get(name) not in (None, [], "none"):
                raise APIError(400, f"'{name}' is a chat field: send it to /v1/chat/completions", name,
                               "unsupported")
        fmt = self.response_format
        if fmt is not None and (fmt.type == "json_schema") != (fmt.json_schema is not None):
            raise APIError(400, "'response_format.json_schema' is required with \"type\": \"json_schema\" "
                           "and only allowed with it", "response_format.json_schema", "invalid_value")
        self.logit_bias_ids  # noqa: B018  its check
        if not (len(self.stop_strings) <= 4 and all(self.stop_strings)):
            raise APIError(400, "'stop' takes at most 4 non-empty strings", "stop", "invalid_value")
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM answer it
            raise APIError(400, "'stream_options' is only allowed with 'stream': true", "stream_options",
                           "invalid_value")

    @property
    def logit_bias_ids(self) -> dict[int, float] | None:
        """logit_bias with int keys; 400 for a key that is no token id or a bias out of [-100, 100] (the ids'
        range is the model's: checks.py)."""
        if not self.logit_bias:
            return None
        out = {}
        for k, v in self.logit_bias.items():
            if not k.isdigit():
                raise APIError(400, f"'logit_bias' keys must be token ids, got {k!r}", "logit_bias",
                               "invalid_value")
            if not -LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT:
                raise APIError(400, f"'logit_bias' values must be in [-{LOGIT_BIAS_LIMIT}, "
                               f"{LOGIT_BIAS_LIMIT}], got {v} for {k}", "logit_bias", "invalid_value")
            out[int(k)] = float(v)
        return out

    def engine_options(self) -> dict[str, Any]:
        """The Engine's add_request keywords that are no generation setting: n choices, log-probabilities
        (logprobs: of the new tokens; prompt_logprobs: of the prompt's, completions' echo), each the number
        of most likely tokens listed beside the token."""
        return {"n": self.n or 1}

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def max_tokens_field(self) -> str:
        """The name the request gave its length under (OpenAI's newer max_completion_tokens wins)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_generation_config(self, defaults: Mapping[str, Any] | None = None,
                             max_new_tokens: int | None = None) -> GenerationConfig:
        """The request's settings as the engine's GenerationConfig, every sampling setting explicit ("off"
        included: the engine applies a request's config over its own base, and a setting left out would keep
        the base's). A sampling field the request leaves out takes `defaults` (the folder's, else OpenAI's:
        RequestChecks.sampling_defaults); max_new_tokens: the length when the request gives none."""
        d = {**OPENAI_SAMPLING, **(defaults or {})}
        pick = {k: getattr(self, k) if getattr(self, k) is not None else d[k] for k in FOLDER_SAMPLING}
        length = self.max_new_tokens if self.max_new_tokens is not None else max_new_tokens
        return GenerationConfig(
            max_new_tokens=length, seed=self.seed,
            do_sample=pick["temperature"] >= MIN_TEMPERATURE,  # below: greedy, the limit (.sampling)
            temperature=float(pick["temperature"]), top_p=float(pick["top_p"]),
            top_k=max(pick["top_k"], 0),  # OpenAI's -1 is GenerationConfig's 0: no top-k
            min_p=float(pick["min_p"]), repetition_penalty=float(pick["repetition_penalty"]),
            presence_penalty=float(self.presence_penalty or 0),
            frequency_penalty=float(self.frequency_penalty or 0),
            logit_bias=self.logit_bias_ids, stop_strings=self.stop_strings or None,
            prompt_lookup_num_tokens=self.prompt_lookup_num_tokens)


# API field -> the GenerationConfig field whose rule it follows (for the error message's bounds)
SETTING_OF = {name: f.json_schema_extra["setting"] for name, f in _Body.model_fields.items()
              if isinstance(f.json_schema_extra, dict) and "setting" in f.json_schema_extra}


class CompletionRequest(_Body):
    """POST /v1/completions: one prompt, text or token ids (a batch of one is taken too)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    # the new tokens' (and with echo the prompt's) log-probabilities, with the `logprobs` most likely tokens
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False  # the prompt comes back before the completion (max_tokens 0: the prompt alone)
    # 0 is for echo alone: the prompt's log-probabilities without a new token (check_supported)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)

    def check_supported(self, chat: bool = False) -> None:
        super().check_supported(chat)
        if self.max_new_tokens == 0 and not self.echo:
            raise APIError(400, f"'{self.max_tokens_field}' must be at least 1 (0 only with echo: the "
                           "prompt's log-probabilities alone)", self.max_tokens_field, "invalid_value")

    def engine_options(self) -> dict[str, Any]:
        k = self.logprobs
        return {**super().engine_options(), "logprobs": k, "prompt_logprobs": k if self.echo else None}


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    url: str
    detail: str | None = None  # OpenAI's resolution hint; a LLaVA model has one resolution


class ImagePart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    """A message; extra keys are kept (an assistant's tool_calls, a tool message's tool_call_id)."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    # None: an assistant message that only calls tools
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        calls = (self.model_extra or {}).get("tool_calls")
        if self.content is None and not (self.role == "assistant" and calls):
            raise ValueError("'content' is required (null only in an assistant's message with tool_calls)")
        return self

    @property
    def text(self) -> str:
        """The content's text: its text parts joined with newlines (as vLLM)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(p.text for p in self.content if isinstance(p, TextPart))

    @property
    def images(self) -> list[str]:
        """The URLs of the content's image parts, in order."""
        return [] if not isinstance(self.content, list) else [
            p.image_url.url for p in self.content if isinstance(p, ImagePart)]


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; None: no arguments
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Body):
    """POST /v1/chat/completions: the conversation, rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None  # rendered by the chat template; calls parsed back (serve/tools.py)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None  # each new token's log-probability
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # ... and its most likely alternatives

    def check_supported(self, chat: bool = True) -> None:
        super().check_supported(chat)
        if self.top_logprobs and not self.logprobs:  # as OpenAI answers it
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")

    def engine_options(self) -> dict[str, Any]:
        return {**super().engine_options(), "logprobs": (self.top_logprobs or 0) if self.logprobs else None}


def parse(body: dict, chat: bool) -> CompletionRequest | ChatCompletionRequest:
    """The request of a JSON object, checked; an APIError (400) naming the first field that is wrong."""
    cls = ChatCompletionRequest if chat else CompletionRequest
    try:
        request = cls.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = errors[0]["loc"][:1]
        # a union (a message's content: a string or a list of parts) reports one error per member: the one
        # that got furthest into the value says what is wrong
        worst = max((x for x in errors if x["loc"][:1] == first), key=lambda x: len(x["loc"]))
        raise _api_error(worst) from None
    request.check_supported(chat)
    return request


MESSAGE_SHAPE = ("an object with string 'role' and 'content' (a string or a list of parts: {\"type\": "
                 "\"text\", \"text\": ...} or {\"type\": \"image_url\", \"image_url\": {\"url\": ...}})")


def _api_error(err: dict[str, Any]) -> APIError:
    """One pydantic error as OpenAI's 400: the field as `param`, the broken rule in words."""
    loc = err["loc"]
    name = str(loc[0]) if loc else None
    got = json.dumps(err.get("input"), default=str)[:60]
    kind = "invalid_value" if "ctx" in err or err["type"] == "too_short" else "invalid_type"
    if name == "messages":
        if len(loc) == 1:
            return APIError(400, f"'messages' must be a non-empty list, got {got}", name, kind)
        param = f"messages[{loc[1]}]"
        code = "unsupported" if err["type"] == "union_tag_invalid" else "invalid_type"
        where = ".".join(str(p) for p in loc[2:] if not str(p).startswith(("str", "list[")))
        return APIError(400, f"{param} must be {MESSAGE_SHAPE} ({where or 'message'}: {err['msg']})",
                        param, code)
    if name == "prompt":
        return APIError(400, "'prompt' is required and must not be empty" if err["type"] == "missing" else
                        "'prompt' must be a string or a list of token ids (one prompt per request)", name,
                        "invalid_value" if err["type"] == "missing" else "invalid_type")
    if err["type"] == "missing":
        return APIError(400, f"'{name}' is required", name, "invalid_type")
    if name in SETTING_OF:
        tp = field_types(GenerationConfig)[SETTING_OF[name]]
        number = "an integer" if int in (tp, *get_args(tp)) else "a number"
        bounds = describe(SETTING_OF[name])
        return APIError(400, f"'{name}' must be {number}{' ' + bounds if bounds else ''}, got {got}", name,
                        kind)
    # stream_options.include_usage, stop.0 (a union's member names left out)
    field = ".".join(str(p) for p in loc if not str(p).startswith(("str", "list[")))
    return APIError(400, f"'{field}': {err['msg']}, got {got}", name, kind)
