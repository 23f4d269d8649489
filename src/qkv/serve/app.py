"""The OpenAI-compatible HTTP API over the Engine (FastAPI).

    POST /v1/completions        {"model", "prompt", "max_tokens", "temperature", "top_p", "stop",
                                "stream", ...}
    POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], ...}  (the model's chat
                                template)
    GET  /v1/models, /v1/models/{id}, /health, /metrics (Prometheus text format)
    GET  /   a chat page (static/chat.html) streaming from /v1/chat/completions

Every request is checked before it reaches the engine (types, ranges, the model name, the context and the
KV pool): a bad one gets OpenAI's error shape {"error": {"message", "type", "param", "code"}} and never
disturbs the others. Admission is bounded: beyond max_batch_size running + max_waiting queued requests the
answer is 429 with Retry-After. `stream: true` sends server-sent events ending with `data: [DONE]`; a
client that goes away mid-stream has its request cancelled (blocks freed) at the next engine step.

Modules: requests.py (the request bodies: pydantic models), checks.py (reading a body, its prompt ids and
engine options), handlers.py (the one request -> engine -> response path), sse.py (the events of a stream),
errors.py (APIError).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from qkv.generate.engine import Engine
from qkv.serve.checks import RequestChecks
from qkv.serve.config import ServeConfig
from qkv.serve.errors import APIError
from qkv.serve.handlers import handle
from qkv.serve.metrics import Metrics, ResponseCounter
from qkv.serve.model import Served
from qkv.serve.worker import EngineWorker, Ticket


class API(RequestChecks):
    """The server's state: request checks (RequestChecks), the engine thread, admission and metrics."""

    def __init__(self, served: Served, engine: Engine, settings: ServeConfig) -> None:
        super().__init__(served, engine, settings)
        self.worker = EngineWorker(engine)
        self.metrics = Metrics(self.worker)
        self.active = 0  # accepted requests not finished (event-loop thread only)
        self.capacity = engine.max_batch_size + settings.max_waiting
        self.shutting_down = False

    def admit(self, prompt: list[int], opts: dict[str, Any]) -> Ticket:
        """The request's ticket once it is accepted: 503 when the server cannot run it, 429 at capacity.
        opts: the engine's add_request keywords (a request's images among them)."""
        if self.worker.error is not None:
            raise APIError(
                503,
                f"the engine stopped after an internal error ({self.worker.error}): the server must "
                "be restarted",
                None,
                "engine_dead",
                "server_error",
            )
        if self.shutting_down or not self.worker.alive:
            raise APIError(503, "the server is shutting down", None, "unavailable", "server_error")
        if self.active >= self.capacity:
            self.metrics.rejected.inc()
            raise APIError(
                429,
                f"the server is at capacity ({self.active} requests running or queued): retry later",
                None,
                "rate_limit_exceeded",
                "rate_limit_error",
                {"Retry-After": "1"},
            )
        self.active += 1
        return self.worker.submit(prompt, opts)

    def release(self, t: Ticket, reason: str | None) -> None:
        """The request is over for the client (idempotent): free its place; cancel it if it still runs."""
        if t.released:
            return
        t.released = True
        if reason is None:
            t.worker.cancel(t)
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
                        raise APIError(
                            500,
                            value,
                            None,
                            "engine_error" if kind == "error" else "request_failed",
                            "server_error",
                        )
                    if kind == "done":
                        done = True
                        yield items[:i + 1]
                        return
                yield items
        finally:
            if watch is not None:
                watch.cancel()
            if not done:
                t.worker.cancel(t)


def _drop_cancel_record(record: logging.LogRecord) -> bool:
    return not (isinstance(record.msg, str) and record.msg.startswith("Cancel %s running task(s)"))


def _quiet_expected_cancel() -> None:
    """uvicorn logs "ERROR: Cancel N running task(s), timeout graceful shutdown exceeded" when
    --shutdown-timeout runs out, which is the documented end of such requests (each is answered "cancelled"):
    not an error. Its logger is configured when uvicorn starts, so the filter goes on at the app's startup
    (once)."""
    logger = logging.getLogger("uvicorn.error")
    if _drop_cancel_record not in logger.filters:
        logger.addFilter(_drop_cancel_record)


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: an APIError raised, a bug (500), no route (404), a bad method (405)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        # a bug: OpenAI's error shape still (a client parses it), not Starlette's plain-text 500; uvicorn logs
        # it
        return APIError(500, f"internal server error ({type(e).__name__}: {str(e)[:200]})", None,
                        "internal_error", "server_error").response()

    @app.exception_handler(404)
    async def _not_found(request: Request, e: Exception) -> JSONResponse:
        return APIError(404, f"no route {request.method} {request.url.path}", None, "not_found").response()

    @app.exception_handler(405)
    async def _bad_method(request: Request, e: Exception) -> JSONResponse:
        return APIError(405, f"{request.method} is not allowed on {request.url.path}", None,
                        "method_not_allowed").response()


def create_app(served: Served, engine: Engine, settings: ServeConfig | None = None) -> FastAPI:
    api = API(served, engine, settings or ServeConfig())

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

    add_error_handlers(app)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: what some load balancers' checks send
    async def health() -> JSONResponse:
        ok = api.worker.alive and not api.shutting_down
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def chat_page() -> str:  # a static page; the conversation and settings live in the browser
        return (resources.files("qkv.serve") / "static" / "chat.html").read_text(encoding="utf-8")

    card = {
        "id": served.name,
        "object": "model",
        "created": served.created,
        "owned_by": "qkv",
        "max_model_len": engine.context,
    }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")  # the openai client's models.retrieve(); ids may hold a "/"
    async def model(model_id: str) -> dict:
        if model_id != served.name:
            raise APIError(
                404,
                f"the model '{model_id}' does not exist; this server has '{served.name}'",
                "model",
                "model_not_found",
            )
        return card

    @app.get("/metrics")
    async def metrics() -> Response:
        body, ctype = api.metrics.render()
        return Response(body, media_type=ctype)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(api, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(api, request, chat=True)

    return app


__all__ = ["API", "APIError", "create_app"]
