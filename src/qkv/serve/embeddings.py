"""POST /v1/embeddings for an encoder folder (BERT / RoBERTa / XLM-R / DistilBERT / DeBERTa, sentence-
transformers folders too): `qkv serve ENCODER_FOLDER` serves this endpoint (and /v1/models, /health) instead
of completions.

    {"model", "input": "a text" | ["texts", ...], "encoding_format": "float" | "base64"}
    -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}

The vectors are `qkv embed`'s (qkv.embed.embed_texts): the folder's pooling (1_Pooling, else mean), cut
length (max_seq_length, else the model's context), L2-normalised. A text longer than that is a 400 naming it
(as OpenAI's and vLLM's servers answer), not cut silently. base64 is the float32 little-endian bytes, what
the official client decodes (it asks for base64 by default). Requests run one at a time on a worker thread:
the event loop keeps answering /health meanwhile.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qkv.embed import embed_texts, folder_max_length, folder_pooling
from qkv.finetune.encoders import open_encoder
from qkv.interop.registry import model_types, names
from qkv.serve.app import add_error_handlers
from qkv.serve.checks import check_text, read_json
from qkv.serve.config import ServeConfig
from qkv.serve.errors import APIError

MAX_INPUTS = 2048  # OpenAI's bound on the texts of one request


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    model: str
    input: str | list[str] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # a Matryoshka model's cut: refused unless it is the model's own width


@dataclass
class Embedder:
    """An encoder folder with the pooling and cut length `qkv embed` reads from it."""

    encoder: Any  # qkv.finetune.encoders.EncoderFolder
    pooling: str
    max_length: int
    name: str
    created: int = field(default_factory=lambda: int(time.time()))
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def width(self) -> int:
        return int(self.encoder.model.config.d_model)

    def token_counts(self, texts: list[str]) -> list[int]:
        """Each text's tokens (its special tokens included), uncut."""
        return [len(e.ids) for e in self.encoder.tokenizer.encode_batch(texts)]

    def embed(self, texts: list[str]) -> np.ndarray:
        out, _ = embed_texts(self.encoder, texts, pooling=self.pooling, max_length=self.max_length)
        return out


def load_embedder(path: str | Path, name: str | None = None) -> Embedder:
    """The folder's encoder, pooling and cut length, as `qkv embed` reads them."""
    encoder = open_encoder(path)
    limit = folder_max_length(path)
    limit = encoder.max_length if limit is None else min(limit, encoder.max_length)
    return Embedder(encoder, folder_pooling(path) or "mean", limit, name or Path(path).resolve().name)


def is_encoder_folder(path: str | Path) -> bool:
    """A Hugging Face encoder folder (a model_type of the encoder recipes): served for embeddings."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, AttributeError):
        return False
    return model_type in names(model_types(kind="encoder"))


def parse_embedding_request(body: dict, embedder: Embedder) -> EmbeddingRequest:
    """The body, checked: a 400 naming the field for what is wrong, a 404 for another model."""
    if body.get("model") != embedder.name:
        raise APIError(404, f"the model '{body.get('model')}' does not exist; this server has "
                       f"'{embedder.name}'", "model", "model_not_found")
    try:
        req = EmbeddingRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        name = str(err["loc"][0]) if err["loc"] else None
        if name == "input":
            msg = ("'input' must be a non-empty string or a non-empty list of strings (token ids are not "
                   "taken)")
        else:
            msg = f"'{name}': {err['msg']}"
        raise APIError(400, msg, name, "invalid_value") from None
    texts = [req.input] if isinstance(req.input, str) else req.input
    if len(texts) > MAX_INPUTS:
        raise APIError(400, f"'input' takes at most {MAX_INPUTS} texts, got {len(texts)}", "input",
                       "invalid_value")
    empty = next((i for i, t in enumerate(texts) if not t), None)
    if empty is not None:
        raise APIError(400, f"'input'[{empty}] is empty", "input", "invalid_value")
    if req.dimensions is not None and req.dimensions != embedder.width:
        raise APIError(400, f"'dimensions' must be the model's width {embedder.width} (no other is made), "
                       f"got {req.dimensions}", "dimensions", "unsupported")
    return req


def embedding_response(req: EmbeddingRequest, vectors: np.ndarray, tokens: int, name: str) -> dict:
    if req.encoding_format == "base64":
        data = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
    else:
        data = [v.tolist() for v in vectors]
    return {"object": "list", "model": name,
            "data": [{"object": "embedding", "index": i, "embedding": d} for i, d in enumerate(data)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def handle_embeddings(embedder: Embedder, request: Request, max_bytes: int) -> JSONResponse:
    body = await read_json(request, max_bytes)
    check_text(body)
    req = parse_embedding_request(body, embedder)
    texts = [req.input] if isinstance(req.input, str) else req.input
    async with embedder.lock:  # one forward at a time: they share the CPU threads / the GPU
        counts = await asyncio.to_thread(embedder.token_counts, texts)
        long = next((i for i, n in enumerate(counts) if n > embedder.max_length), None)
        if long is not None:
            raise APIError(400, f"'input'[{long}] has {counts[long]} tokens; this model takes at most "
                           f"{embedder.max_length}", "input", "context_length_exceeded")
        vectors = await asyncio.to_thread(embedder.embed, texts)
    return JSONResponse(embedding_response(req, vectors, sum(counts), embedder.name))


def create_embeddings_app(embedder: Embedder, settings: ServeConfig | None = None) -> FastAPI:
    """The app of an encoder folder: /v1/embeddings, /v1/models, /health; errors in OpenAI's shape."""
    settings = settings if settings is not None else ServeConfig()
    app = FastAPI(title="qkv serve (embeddings)")
    app.state.embedder = embedder
    add_error_handlers(app)
    card = {"id": embedder.name, "object": "model", "created": embedder.created, "owned_by": "qkv",
            "max_model_len": embedder.max_length}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        return await handle_embeddings(embedder, request, settings.max_request_bytes)

    return app
