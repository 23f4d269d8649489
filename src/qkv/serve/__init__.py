"""`qkv serve`: an OpenAI-compatible HTTP server over the continuous-batching Engine (docs/serving.md).

    qkv serve runs/charlm --port 8000           # a qkv run folder, a qkv checkpoint or a Hugging Face folder
    curl 127.0.0.1:8000/v1/completions -d '{"model": "charlm", "prompt": "ROMEO:", "max_tokens": 32}'

Modules: server.py (the server's life: load, engine, bind, drain), config.py (its settings),
model.py (model + tokenizer of a folder), worker.py (the engine thread), app.py (the FastAPI app:
endpoints, request checks, SSE), metrics.py (Prometheus).
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it. Imported on first use (PEP 562), so that the settings modules
# (qkv.serve.config) load without fastapi and torch: `qkv serve --help` reads them.
_EXPORTS = {
    "APIError": "qkv.serve.app", "create_app": "qkv.serve.app",
    "EngineConfig": "qkv.generate.engine_config", "ServeConfig": "qkv.serve.config",
    "Served": "qkv.serve.model", "TextCodec": "qkv.serve.model", "load_served": "qkv.serve.model",
    "build_engine": "qkv.serve.server", "serve": "qkv.serve.server",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qkv.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
