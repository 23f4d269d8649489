"""The decoder protocol: everything qkv.generate (search, beam search, stream, the serving Engine) needs
from a model, and nothing else. GPT, EncoderDecoder, Whisper and the LSTM implement it; generation never
looks inside a model (no hasattr probing of embeddings, stacks or configs).

    model.is_seq2seq                 the prompt is an encoder input; the decoder starts from a start token
    model.context_limit              most decoder positions (None: no hard limit, e.g. RoPE / ALiBi / LSTM)
    model.output_vocab_size          width of the logits
    model.generation_defaults()      HF-named defaults: eos/pad/bos/decoder_start token ids, and a loaded
                                     folder's generation_config.json
    model.make_cache(B, max_len)     a cache for B rows (StaticCache; the LSTM's recurrent state)
    model.make_paged_cache(n, bs)    a PagedKVCache over n blocks of bs positions (serving; n=None: enough
                                     for max_batch_size sequences of the model's context)
    model.encode_source(x, mask)     check the generation input once (it enters here); seq2seq: run the
                                     encoder -> Source; decoder-only: None
    model.prefill(ids, cache, ...)   the full forward over a prompt (or, with cache=None, a recomputation):
                                     next-token logits (B, V) and, on request, attention weights
    model.step(ids, cache, ...)      the fast decoding step over a filled cache -> logits (B, V)

Conventions shared by prefill and step: `keep` is the (B, cached + new) bool key mask (None: every key is
real); `offset` the position of ids[:, 0], an int or a per-row (B,) tensor (left padding, paged cache;
default: the cache's length). Both advance the cache by the number of ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor


@dataclass
class Source:
    """An encoded generation input (seq2seq): the encoder memory (B, S, d) and its keep-mask (B, S)."""

    memory: Tensor
    mask: Tensor | None = None

    def repeat_interleave(self, n: int) -> Source:
        """Each row n times (beams, several samples per source)."""
        if n == 1:
            return self
        mask = None if self.mask is None else self.mask.repeat_interleave(n, 0)
        return Source(self.memory.repeat_interleave(n, 0), mask)

    def select_rows(self, rows: Tensor) -> Source:
        """Row i is row rows[i] (beam search repeats each input's row for its beams after the first step)."""
        mask = None if self.mask is None else self.mask.index_select(0, rows)
        return Source(self.memory.index_select(0, rows), mask)


def configured_context(model: Any) -> int | None:
    """The most positions a model is meant to see: its hard context_limit (absolute positions, a sliding
    window); for a RoPE or ALiBi decoder, the context_length it was configured with (a Llama folder's
    max_position_embeddings) where that is smaller: positions past it run, but the model was not trained on
    them. None: no limit known (the LSTM, positions "none")."""
    limit = getattr(model, "context_limit", None)
    config = getattr(model, "config", None)
    trained = getattr(config, "context_length", None)
    if getattr(config, "position", None) not in ("rope", "alibi") or not isinstance(trained, int):
        return limit
    # a sliding window's limit may lie past the context
    return trained if limit is None else min(limit, trained)


@runtime_checkable
class Decoder(Protocol):
    is_seq2seq: bool

    @property
    def context_limit(self) -> int | None: ...

    @property
    def output_vocab_size(self) -> int: ...

    def generation_defaults(self) -> dict[str, Any]: ...

    def make_cache(self, batch_size: int, max_len: int | None = None, *, dtype: Any = None,
                   device: Any = None) -> Any: ...

    def make_paged_cache(self, num_blocks: int | None = None, block_size: int = 16, *,
                         max_batch_size: int = 1, dtype: Any = None, device: Any = None) -> Any: ...

    def encode_source(self, inputs: Tensor, attention_mask: Tensor | None = None) -> Source | None: ...

    def prefill(self, ids: Tensor, cache: Any, *, keep: Tensor | None = None,
                offset: int | Tensor | None = None,
                source: Source | None = None,
                return_attentions: bool = False) -> tuple[Tensor, list | None]: ...

    def step(self, ids: Tensor, cache: Any, *, keep: Tensor | None = None,
             offset: int | Tensor | None = None) -> Tensor: ...


def as_decoder(model: Any) -> Decoder:
    """`model` itself, after checking that it implements the protocol (a clear error otherwise)."""
    if not isinstance(model, Decoder):
        raise TypeError(f"{type(model).__name__} cannot generate: it does not implement qkv's decoder "
                        f"protocol (qkv.models.decoding.Decoder)")
    return model
