"""Autoregressive generation for every qkv decoder (GPT, encoder-decoder).

  generate(model, input_ids, max_new_tokens, ...)   greedy / sampling / beam search (also model.generate)
  stream(model, input_ids, max_new_tokens, ...)     the same tokens, yielded step by step
  beam_search(...)                                  the beam search itself (any num_beams >= 1)
  PagedKVCache, BlockAllocator, Engine              a paged KV cache and continuous batching (GPT family)

Modules: sampling.py (temperature / top-k / top-p), search.py (decoding loops), paged.py (block pool and
paged cache), engine.py (continuous-batching Engine).
"""

from __future__ import annotations

from qkv.generate.engine import Engine
from qkv.generate.paged import BlockAllocator, PagedKVCache
from qkv.generate.sampling import process_logits, sample, top_k_filter, top_p_filter
from qkv.generate.search import GenerationOutput, beam_search, generate, stream

__all__ = ["BlockAllocator", "Engine", "GenerationOutput", "PagedKVCache", "beam_search", "generate",
           "process_logits", "sample", "stream", "top_k_filter", "top_p_filter"]
