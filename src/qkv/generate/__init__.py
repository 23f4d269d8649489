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
graphed.py (the decoding step compiled over the static cache),
text.py (StreamDecoder, the one detokenising stream, and stream_pieces, the one streaming loop). The
continuous-batching Engine in parts, as vLLM v1: engine.py (the model runner and the public API),
scheduler.py (admission, chunked prefill, preemption), blocks.py (KV block allocation, prefix cache),
sampler.py (processors, per-request seeds), output.py (outputs, stop strings, finish reasons). The paged
cache itself is a KV cache like the others: qkv.nn.paged (re-exported here).
"""

from __future__ import annotations

from qkv.generate.config import GenerationConfig
from qkv.generate.engine import Engine
from qkv.generate.processors import PROCESSORS, WARPERS, LogitsProcessor, Pipeline
from qkv.generate.sampling import process_logits, sample, top_k_filter, top_p_filter
from qkv.generate.search import GenerationOutput, beam_search, generate, stream
from qkv.nn.paged import BlockAllocator, PagedKVCache

__all__ = ["PROCESSORS", "WARPERS", "BlockAllocator", "Engine", "GenerationConfig", "GenerationOutput",
           "LogitsProcessor", "PagedKVCache", "Pipeline", "beam_search", "generate", "process_logits",
           "sample", "stream", "top_k_filter", "top_p_filter"]
