"""The OpenAI-compatible HTTP API over the Engine (FastAPI).

    POST /v1/completions        {"model", "prompt", "max_tokens", "temperature", "top_p", "stop", "stream", ...}
    POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], ...}  (the model's chat template)
    GET  /v1/models, /v1/models/{id}, /health, /metrics (Prometheus text format)

Every request is checked before it reaches the engine (types, ranges, the model name, the context and the
KV pool): a bad one gets OpenAI's error shape {"error": {"message", "type", "param", "code"}} and never
disturbs the others. Admission is bounded: beyond max_batch_size running + max_waiting queued requests the
answer is 429 with Retry-After. `stream: true` sends server-sent events ending with `data: [DONE]`; a
client that goes away mid-stream has its request cancelled (blocks freed) at the next engine step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from qkv.generate.config import MIN_TEMPERATURE
from qkv.generate.engine import TEXT_CONTEXT, Engine
from qkv.generate.text import StreamDecoder, cut_at_stop
from qkv.generate.text import decode_continuation as continuation
from qkv.serve.metrics import Metrics, ResponseCounter
from qkv.serve.model import Served
from qkv.serve.worker import EngineWorker, Ticket

_MARK = "\x00piece\x00"  # a stand-in text that json.dumps writes in one unmistakable way
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what the context leaves
# the smallest repetition_penalty accepted: seen tokens' positive logits are divided by it, and 1e-300 overflowed
# float32 (inf, then NaN probabilities); at 0.01 a logit of 1e4 becomes 1e6, far from float32's 3e38, and a 100x
# boost of every seen token is already past any useful setting
MIN_REPETITION_PENALTY = 0.01


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _cancelled(shutdown: bool) -> APIError:
    """A request the server cut short: a 503 before the status line, an event + [DONE] after it. shutdown: uvicorn
    cancelled it, --shutdown-timeout having run out."""
    why = "the server is shutting down" if shutdown else "client gone or server shutting down"
    return APIError(503, f"the request was cancelled ({why})", None, "cancelled", "server_error")


@dataclass
class ServeSettings:
    max_waiting: int = 64  # queued requests beyond the running batch before 429
    max_tokens_cap: int = 1024  # chat requests without max_tokens: at most this many (and what fits)


# -- request checking -----------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_text(body: dict) -> None:
    """400 for a string holding a lone UTF-16 surrogate ("\\ud800" is legal JSON, but no text: the tokenizer
    cannot encode it), naming the field it is in."""
    for name, value in body.items():
        try:
            json.dumps({name: value}, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            bad = e.object[e.start:e.end].encode("unicode_escape").decode("ascii")
            raise APIError(400, f"'{name}' holds a lone surrogate ({bad}), which is not text", name,
                           "invalid_value") from None


def _field(body: dict, name: str, check, what: str, default: Any = None) -> Any:
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
    """400 for OpenAI fields this server does not implement, set to anything but their "off" value: answering as
    if they had been honoured would be worse (a logit_bias or a JSON response_format silently ignored)."""
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


class API:
    def __init__(self, served: Served, engine: Engine, settings: ServeSettings) -> None:
        self.served, self.engine, self.settings = served, engine, settings
        folder = served.model.generation_defaults()
        self.sampling_defaults = {**OPENAI_SAMPLING, **{k: folder[k] for k in FOLDER_SAMPLING
                                                         if folder.get(k) is not None}}
        self.worker = EngineWorker(engine)
        self.metrics = Metrics(self.worker)
        self.active = 0  # accepted requests not finished (event-loop thread only)
        self.capacity = engine.max_batch_size + settings.max_waiting
        self.shutting_down = False

    # -- the parts every endpoint shares ---------------------------------------------------------------
    async def body(self, request: Request) -> dict:
        try:
            raw = await request.body()
        except ClientDisconnect:  # nobody to answer; uvicorn would log a traceback for each such client
            client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
            logging.getLogger("uvicorn.error").warning("%s went away before sending its whole request body", client)
            raise APIError(400, "the request body was cut short", None, "incomplete_body") from None
        try:
            body = json.loads(raw)
        # JSONDecodeError and UnicodeDecodeError are ValueErrors, as is an integer of over 4300 digits; nesting
        # too deep for the parser is a RecursionError: all of them a malformed body, not a server error
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"the request body is not valid JSON ({str(e)[:200]})", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", None, "invalid_json")
        _check_text(body)
        model = body.get("model")
        if not isinstance(model, str):
            raise APIError(400, "'model' is required (a string: see GET /v1/models)", "model", "invalid_type")
        if model != self.served.name:
            raise APIError(404, f"the model '{model}' does not exist; this server has '{self.served.name}'",
                           "model", "model_not_found")
        return body

    def options(self, body: dict, prompt_len: int, default_max: int | None) -> dict[str, Any]:
        """Engine options of a request, checked; 400 for what cannot run."""
        n = _field(body, "n", _is_int, "an integer", 1)
        _range(n == 1, "n", f"must be 1: this server returns one choice per request (got {n})")
        if _field(body, "best_of", _is_int, "an integer", 1) != 1:
            raise APIError(400, "'best_of' > 1 is not supported", "best_of", "unsupported")
        _refuse_unsupported(body, "messages" in body)
        for name in ("presence_penalty", "frequency_penalty"):
            v = _field(body, name, _is_num, "a number", 0)
            _range(v == 0, name, "is not supported (only 0)")
        # each sampling field: the request's value, else the folder's default, else OpenAI's (sampling_defaults)
        d = self.sampling_defaults
        temperature = _field(body, "temperature", _is_num, "a number", d["temperature"])
        _range(0 <= temperature <= 2, "temperature", f"must be in [0, 2], got {temperature}")
        top_p = _field(body, "top_p", _is_num, "a number", d["top_p"])
        _range(0 < top_p <= 1, "top_p", f"must be in (0, 1], got {top_p}")
        top_k = _field(body, "top_k", _is_int, "an integer", d["top_k"])  # extensions from here, as vLLM's
        _range(top_k >= -1, "top_k", f"must be -1 or 0 (off) or >= 1, got {top_k}")
        min_p = _field(body, "min_p", _is_num, "a number", d["min_p"])
        _range(0 <= min_p <= 1, "min_p", f"must be in [0, 1], got {min_p}")
        repetition = _field(body, "repetition_penalty", _is_num, "a number", d["repetition_penalty"])
        # bounded below too: seen logits are divided by it, and 1e-300 made them inf (then NaN probabilities)
        _range(MIN_REPETITION_PENALTY <= repetition <= 10, "repetition_penalty",
               f"must be in [{MIN_REPETITION_PENALTY}, 10], got {repetition}")
        seed = _field(body, "seed", _is_int, "an integer")
        _range(seed is None or -(2 ** 63) <= seed < 2 ** 64, "seed", f"must be a 64-bit integer, got {seed}")
        stop = _field(body, "stop", lambda v: isinstance(v, str) or (isinstance(v, list) and all(
            isinstance(s, str) for s in v)), "a string or a list of strings")
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        _range(len(stop) <= 4 and all(stop), "stop", "takes at most 4 non-empty strings")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _field(body, name, _is_int, "an integer")
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
            # without max_tokens the request asked for what fits: the prompt alone does not, and is what to change
            prompt_field = "messages" if "messages" in body else "prompt"
            raise APIError(400, f"{e}: lower max_tokens or shorten the prompt" if given else
                           f"{e}: the prompt of {prompt_len} tokens alone does not fit; shorten it",
                           name if given else prompt_field, "context_length_exceeded") from None
        # every setting explicit, "off" included: the engine applies a request's options over its own base
        # config (build_engine: the folder's token ids only), and an option left out would keep that base's value
        opts: dict[str, Any] = {
            "max_new_tokens": max_tokens, "seed": seed,
            "do_sample": temperature >= MIN_TEMPERATURE,  # below: greedy, the limit (GenerationConfig.sampling)
            "temperature": float(temperature), "top_p": float(top_p), "top_k": max(top_k, 0), "min_p": float(min_p),
            "repetition_penalty": float(repetition)}
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
            if isinstance(content, list):  # OpenAI's content parts: text ones joined (as vLLM), others refused
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise APIError(400, f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": "
                                   "...}) are supported by this server", f"messages[{i}]", "unsupported")
                content = "\n".join(p["text"] for p in content)
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(content, str)):
                raise APIError(400, f"messages[{i}] must be an object with string 'role' and 'content' (a string "
                               "or a list of text parts)", f"messages[{i}]", "invalid_type")
            clean.append({"role": m["role"], "content": content})
        if not self.served.codec.has_chat_template:
            raise APIError(400, f"the model '{self.served.name}' has no chat template: use /v1/completions",
                           "messages", "no_chat_template")
        try:
            ids = self.served.codec.chat_prompt(clean)
        except Exception as e:  # a template's own raise_exception (e.g. roles must alternate)
            raise APIError(400, f"the chat template rejected the messages: {e}", "messages", "invalid_value") from None
        if not ids:
            raise APIError(400, "the rendered chat prompt is empty", "messages", "invalid_value")
        return ids

    def admit(self, prompt: list[int], opts: dict[str, Any]) -> Ticket:
        if self.worker.error is not None:
            raise APIError(503, f"the engine stopped after an internal error ({self.worker.error}): the server must "
                           "be restarted", None, "engine_dead", "server_error")
        if self.shutting_down or not self.worker.alive:
            raise APIError(503, "the server is shutting down", None, "unavailable", "server_error")
        if self.active >= self.capacity:
            self.metrics.rejected.inc()
            raise APIError(429, f"the server is at capacity ({self.active} requests running or queued): retry "
                           "later", None, "rate_limit_exceeded", "rate_limit_error", {"Retry-After": "1"})
        self.active += 1
        return self.worker.submit(prompt, opts)

    def release(self, t: Ticket, reason: str | None) -> None:
        """The request is over for the client (idempotent): free its place; cancel it if it still runs."""
        if t.released:
            return
        t.released = True
        if reason is None:
            self.worker.cancel(t)
        self.active -= 1
        self.metrics.observe(t, reason)

    # -- generation ------------------------------------------------------------------------------------
    async def batches(self, t: Ticket, request: Request) -> AsyncIterator[list[tuple[str, Any]]]:
        """The ticket's items as the engine steps deliver them: lists of ("token", id), the last one ending
        with ("done", reason). Cancels the request if the consumer stops early (a disconnected client) or the
        client disconnects while we wait. One wait per delivery (an engine step), not per token; the
        disconnect check runs when a 1 s watchdog wakes a wait that got nothing."""
        done = False
        loop = t.loop
        watch: asyncio.TimerHandle | None = None

        def tick() -> None:
            nonlocal watch
            t.wake()
            watch = loop.call_later(1.0, tick)

        try:
            watch = loop.call_later(1.0, tick)
            while True:
                if not t.items:
                    t.waiter = loop.create_future()
                    await t.waiter
                    if not t.items:  # the watchdog
                        if await request.is_disconnected():
                            return
                        continue
                items, t.items = t.items, []
                for i, (kind, value) in enumerate(items):
                    if kind in ("error", "failed"):  # the engine died / this request failed alone
                        done = True
                        raise APIError(500, value, None, "engine_error" if kind == "error" else "request_failed",
                                       "server_error")
                    if kind == "done":
                        done = True
                        yield items[:i + 1]
                        return
                yield items
        finally:
            if watch is not None:
                watch.cancel()
            if not done:
                self.worker.cancel(t)


class _Stream(StreamingResponse):
    """A StreamingResponse that always runs on_close, even when the client is gone before the body's first
    chunk (the generator's own finally never runs then), and that ends quietly when uvicorn cancels it at the
    end of a graceful shutdown (the stream has sent its last event: events() in create_app)."""

    def __init__(self, content: Any, on_close: Any, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:  # uvicorn stops the task either way; re-raised, it logs a traceback
            pass
        finally:
            self.on_close()


def _drop_cancel_record(record: logging.LogRecord) -> bool:
    return not (isinstance(record.msg, str) and record.msg.startswith("Cancel %s running task(s)"))


def _quiet_expected_cancel() -> None:
    """uvicorn logs "ERROR: Cancel N running task(s), timeout graceful shutdown exceeded" when --shutdown-timeout
    runs out, which is the documented end of such requests (each is answered "cancelled"): not an error. Its
    logger is configured when uvicorn starts, so the filter goes on at the app's startup (once)."""
    logger = logging.getLogger("uvicorn.error")
    if _drop_cancel_record not in logger.filters:
        logger.addFilter(_drop_cancel_record)


def create_app(served: Served, engine: Engine, settings: ServeSettings | None = None) -> FastAPI:
    api = API(served, engine, settings or ServeSettings())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        _quiet_expected_cancel()
        api.worker.start()
        try:
            yield
        finally:
            api.shutting_down = True
            api.worker.stop()

    app = FastAPI(title="qkv serve", lifespan=lifespan)
    app.state.api = api
    app.add_middleware(ResponseCounter, counter=api.metrics.responses)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        # a bug: OpenAI's error shape still (a client parses it), not Starlette's plain-text 500; uvicorn logs it
        return APIError(500, f"internal server error ({type(e).__name__}: {str(e)[:200]})", None,
                        "internal_error", "server_error").response()

    @app.exception_handler(404)
    async def _not_found(request: Request, e: Exception) -> JSONResponse:
        return APIError(404, f"no route {request.method} {request.url.path}", None, "not_found").response()

    @app.exception_handler(405)
    async def _bad_method(request: Request, e: Exception) -> JSONResponse:
        return APIError(405, f"{request.method} is not allowed on {request.url.path}", None,
                        "method_not_allowed").response()

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: what some load balancers' checks send
    async def health() -> JSONResponse:
        ok = api.worker.alive and not api.shutting_down
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    card = {"id": served.name, "object": "model", "created": served.created, "owned_by": "qkv", "max_model_len": engine.context}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")  # the openai client's models.retrieve(); ids may hold a "/"
    async def model(model_id: str) -> dict:
        if model_id != served.name:
            raise APIError(404, f"the model '{model_id}' does not exist; this server has '{served.name}'", "model",
                           "model_not_found")
        return card

    @app.get("/metrics")
    async def metrics() -> Response:
        body, ctype = api.metrics.render()
        return Response(body, media_type=ctype)

    async def run(request: Request, chat: bool) -> Response:
        body = await api.body(request)
        # off the event loop: a long prompt's tokenizing (or template) must not stall the other clients' streams
        ids = await asyncio.to_thread(api.chat_ids if chat else api.prompt_ids, body)
        opts = api.options(body, len(ids), None if chat else DEFAULT_MAX_TOKENS)
        stream = _field(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
        so = _field(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
        if body.get("stream_options") is not None and not stream:  # as OpenAI and vLLM answer it
            raise APIError(400, "'stream_options' is only allowed with 'stream': true", "stream_options",
                           "invalid_value")
        include_usage = so.get("include_usage")
        if include_usage is not None and not isinstance(include_usage, bool):  # "no" is not false
            raise APIError(400, f"'stream_options.include_usage' must be a boolean, got "
                           f"{json.dumps(include_usage)[:60]}", "stream_options", "invalid_type")
        t = api.admit(ids, opts)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        # the prompt's last ids as context: the engine's stop check reads the same ones
        context = ids[-TEXT_CONTEXT:]
        text = StreamDecoder(served.codec.decode, opts.get("stop_strings", []), context)
        base = {"id": rid, "created": created, "model": served.name}
        if not stream:
            ids_out: list[int] = []
            reason = None
            try:
                async for items in api.batches(t, request):
                    for kind, v in items:
                        if kind == "token":
                            ids_out.append(v)
                        else:
                            reason = v
            except asyncio.CancelledError:  # --shutdown-timeout ran out (uvicorn cancels what still runs)
                raise _cancelled(shutdown=True) from None
            finally:
                api.release(t, reason)
            if reason is None or reason == "cancelled":
                raise _cancelled(shutdown=False)
            content = cut_at_stop(continuation(served.codec.decode, context, ids_out), text.stop)
            n = len(ids_out)
            usage = {"prompt_tokens": t.prompt_len, "completion_tokens": n, "total_tokens": t.prompt_len + n}
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": reason,
                          "logprobs": None}
                return JSONResponse({**base, "object": "chat.completion", "choices": [choice], "usage": usage})
            choice = {"index": 0, "text": content, "finish_reason": reason, "logprobs": None}
            return JSONResponse({**base, "object": "text_completion", "choices": [choice], "usage": usage})

        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: str | None, reason: str | None, first: bool = False, **extra: Any) -> str:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else (
                    {"content": piece} if piece else {})
                choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": reason, "logprobs": None}
            return f"data: {json.dumps({**base, 'object': obj, 'choices': [choice], **extra})}\n\n"

        # a token's event is chunk(piece, None) with only the piece changing: made once, the piece put in
        # with json.dumps (the same bytes as chunk's, tests/serve: no dict and no whole-object dumps a token)
        head, tail = chunk(_MARK, None).split(json.dumps(_MARK))

        def error_event(e: APIError) -> str:
            return f"data: {json.dumps(json.loads(e.response().body))}\n\ndata: [DONE]\n\n"

        async def events() -> AsyncIterator[str]:
            n, reason = 0, None
            try:
                if chat:
                    yield chunk(None, None, first=True)
                try:
                    async for items in api.batches(t, request):
                        out = []
                        for kind, v in items:
                            if kind == "token":
                                n += 1
                                piece = text.push(v)
                                if piece:
                                    out.append(head + json.dumps(piece) + tail)
                            else:
                                reason = v
                        if out:  # the events of one delivery in one write
                            yield "".join(out)
                except APIError as e:  # the status line is long gone: the error as an event, as vLLM sends it
                    yield error_event(e)
                    return
                except asyncio.CancelledError:
                    # uvicorn cancels the responses still running when --shutdown-timeout runs out: end the stream
                    # as any other ends, with a reason, rather than cut it (a client would wait for more), and
                    # without an "Exception in ASGI application" traceback (_Stream.__call__)
                    yield error_event(_cancelled(shutdown=True))
                    return
                if reason == "cancelled":  # by the engine thread's end (shutdown): say so; None: the client left
                    yield error_event(_cancelled(shutdown=False))
                if reason in (None, "cancelled"):
                    return
                tail_text = text.flush()
                usage = {"prompt_tokens": t.prompt_len, "completion_tokens": n, "total_tokens": t.prompt_len + n}
                if include_usage:  # OpenAI's form: usage only on a last chunk of its own
                    yield chunk(tail_text, reason, usage=None)
                    yield f"data: {json.dumps({**base, 'object': obj, 'choices': [], 'usage': usage})}\n\n"
                else:  # an extension (as vLLM's continuous usage): the last chunk carries it
                    yield chunk(tail_text, reason, usage=usage)
                yield "data: [DONE]\n\n"
            finally:
                api.release(t, reason)

        return _Stream(events(), lambda: api.release(t, None), media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run(request, chat=True)

    return app

