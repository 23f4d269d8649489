"""Autoregressive generation for every model that implements the decoder protocol (qkv.models.decoding).

  generate(model, input_ids, config_or_max_new, **options)  greedy / sampling / beam search
                                                            (also model.generate)
  stream(model, input_ids, ...)                             the same tokens, yielded step by step
  beam_search(...)                                          the beam search itself (any num_beams >= 1)
  GenerationConfig                                          every setting, HF field names,
                                                            generation_config.json
  Engine                                                    continuous batching over a paged KV cache

Modules: config.py (GenerationConfig), processors.py (one class per logits option), sampling.py (top-k /
top-p filters and the draw), search.py and beams.py (decoding loops, beam search), inputs.py (prompt checks),
graphed.py (the decoding step compiled over the static cache), speculative.py (drafts by prompt lookup or an
assistant model, verified k at a time),
text.py (StreamDecoder, the one detokenising stream, and stream_pieces, the one streaming loop). The
continuous-batching Engine in parts, as vLLM v1: engine.py (the model runner and the public API),
scheduler.py (admission, chunked prefill, preemption), blocks.py (KV block allocation, prefix cache),
sampler.py (processors, per-request seeds), output.py (outputs, stop strings, finish reasons). The paged
cache itself is a KV cache like the others: qkv.nn.paged (re-exported here).
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it, imported on first use (PEP 562): the settings modules (config.py,
# engine_config.py) then load without torch, and the CLI's --help reads them at once
_EXPORTS = {
    "GenerationConfig": "qkv.generate.config", "Engine": "qkv.generate.engine",
    "EngineConfig": "qkv.generate.engine_config",
    "PROCESSORS": "qkv.generate.processors", "WARPERS": "qkv.generate.processors",
    "LogitsProcessor": "qkv.generate.processors", "Pipeline": "qkv.generate.processors",
    "sample": "qkv.generate.sampling",
    "top_k_filter": "qkv.generate.sampling", "top_p_filter": "qkv.generate.sampling",
    "GenerationOutput": "qkv.generate.search", "beam_search": "qkv.generate.search",
    "generate": "qkv.generate.search", "stream": "qkv.generate.search",
    "BlockAllocator": "qkv.nn.paged", "PagedKVCache": "qkv.nn.paged",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qkv.generate' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
