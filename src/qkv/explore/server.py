"""The explorer's ASGI app (FastAPI, served by uvicorn): one static page and a small JSON API.

  GET  /                 the page (static/index.html + explore.js + explore.css)
  GET  /api/info         the model: family, kind, layers, heads, context, what input it takes
  POST /api/analyze      {"input", "target"?, "image"?, "wav"?} -> tokens + attention of every layer and head
  POST /api/generate     {"input", "max_new_tokens", "do_sample", "temperature", "top_k", "seed",
                          "block_size"}
                         -> each new token, its attention row, top-10 probabilities, KV cache bytes
  GET  /api/positions    the positional encodings as tables

Every error is JSON {"error": "..."}: a user error (empty text, over the context, unknown characters, bad
field) is a 400/422 with the message the page shows; anything else is a 500 with a one-line message,
and the traceback goes to the server log only.
"""

from __future__ import annotations

import errno
import socket
from importlib import resources
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, Field

from qkv.explore import analysis
from qkv.explore.adapter import ExploreError, Loaded


def static_text(name: str) -> str:
    return (resources.files("qkv.explore") / "static" / name).read_text(encoding="utf-8")


class AnalyzeRequest(BaseModel):
    input: str = ""
    target: str | None = None  # encoder-decoders: the decoder input (default: the greedy output)
    image: int = Field(0, ge=0)  # image models: index of a built-in image
    wav: str | None = None  # audio models: a base64 WAV file
    max_target_tokens: int = Field(32, ge=1, le=256)


class GenerateRequest(BaseModel):
    input: str = ""
    max_new_tokens: int = 16
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None  # with temperature, checked by GenerationConfig's rule (analysis.generation)
    seed: int = 0
    block_size: int = 16
    wav: str | None = None


def create_app(ld: Loaded) -> Any:
    """The FastAPI app for one loaded model."""
    app = FastAPI(title="qkv explore", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ExploreError)
    async def user_error(request: Request, exc: ExploreError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return JSONResponse({"error": f"bad request: {where}: {first.get('msg', 'invalid')}"},
                            status_code=422)

    @app.exception_handler(ValueError)
    async def model_check(request: Request, exc: ValueError) -> JSONResponse:
        # a check inside qkv (a length, a token id) is a user error too: say what qkv said
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this response is sent, so uvicorn logs the traceback (server side only)
        return JSONResponse({"error": f"internal error ({type(exc).__name__}); see the server log"},
                            status_code=500)

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        return static_text("index.html")

    @app.get("/static/{name}")
    def static(name: str) -> Response:
        types = {"explore.js": "text/javascript", "explore.css": "text/css"}
        if name not in types:
            return JSONResponse({"error": f"no static file {name!r}"}, status_code=404)
        return Response(static_text(name), media_type=types[name])

    @app.get("/api/info")
    def info() -> dict[str, Any]:
        return analysis.info(ld)

    @app.post("/api/analyze")
    def analyze(req: AnalyzeRequest) -> dict[str, Any]:
        return analysis.analyze(ld, req.input, target=req.target, image_index=req.image, wav_base64=req.wav,
                                max_target_tokens=req.max_target_tokens)

    @app.post("/api/generate")
    def generate(req: GenerateRequest) -> dict[str, Any]:
        return analysis.generation(ld, req.input, max_new_tokens=req.max_new_tokens, do_sample=req.do_sample,
                                   temperature=req.temperature, top_k=req.top_k, seed=req.seed,
                                   block_size=req.block_size, wav_base64=req.wav)

    @app.get("/api/positions")
    def positions() -> dict[str, Any]:
        with ld.lock:
            return analysis.positions(ld)

    return app


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) and listening, or a one-line ExploreError: uvicorn, left to bind it
    itself, logs the failure and exits with status 3 (sys.exit), past the CLI's error handling."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise ExploreError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT is free to reuse
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ExploreError(f"port {port} on {host} is in use: choose another with --port") from None
        raise ExploreError(f"cannot listen on {host} port {port}: {e.strerror or e}") from None
    return sock


def serve(ld: Loaded, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the app with uvicorn until interrupted, on a socket bound here first (see listen)."""
    sock = listen(host, port)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"qkv explore: listening on {host}: anyone who can reach this address can use the model")
    print(f"qkv explore: http://{'[' + host + ']' if ':' in host else host}:{port}/  (Ctrl-C to stop)",
          flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(ld), log_level="warning"))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
