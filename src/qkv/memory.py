"""Memory a user can see: the KV cache's bytes per token, and a training step's memory, from a model's config.

KV cache (001 §4.4: at long contexts the cache, not the weights, fills the accelerator). Per token and layer a
decoder caches what its attention reads back at every later step:

  MHA / GQA / MQA   K and V of every key/value head: 2 x n_kv_heads x head_dim numbers
                    (GQA: fewer key/value heads than query heads; MQA: one)
  MLA               the compressed latent and the shared rotary key: kv_lora_rank + qk_rope_head_dim numbers
                    (nn/mla.py: the heads' K and V are recomputed from the latent)

times the layers and the cache's dtype size. An encoder-decoder also keeps the encoder output's
cross-attention K and V, 2 x n_kv_heads x head_dim per source token and decoder layer, computed once per
source.

Training (000 §5.3): weights, their gradients, AdamW's two moment tensors (the parameters' dtype), and the
activations autograd saves for the backward pass. The activation count follows what qkv's blocks save (the
inputs of each norm and linear, the attention's q/k/v/output and, with the naive backend, the T x T score and
probability matrices; the feed-forward's hidden layer once or, gated, three times) and the logits with their
log-softmax. With gradient checkpointing each block keeps only its input, and one block's activations live
again while it is recomputed. `LiveTensorBytes` measures the same quantities on a real step: the benchmark
(benchmarks/train_memory.py) and tests/test_memory.py compare the two.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from qkv.config import ConfigError
from qkv.models.base import Seq2SeqModel, TransformerDecoderModel
from qkv.models.gpt import GPT

ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, one tensor each per trainable parameter


@dataclass(frozen=True)
class KVCacheSize:
    """A decoder's KV cache: the numbers it keeps per token (over all layers), the dtype it keeps them in."""

    layout: str  # MHA | GQA | MQA | MLA
    n_layers: int
    per_layer: str  # what one layer caches per token, in words
    numbers_per_token: int  # over all layers
    dtype: torch.dtype
    context: int | None  # the model's context (positions), where its config gives one
    cross_numbers_per_source_token: int = 0  # encoder-decoder: the cross-attention K/V per source position
    source_context: int | None = None  # the longest source (an encoder-decoder's encoder positions)

    @property
    def bytes_per_token(self) -> int:
        return self.numbers_per_token * self.dtype.itemsize

    @property
    def cross_bytes_per_source_token(self) -> int:
        return self.cross_numbers_per_source_token * self.dtype.itemsize

    def bytes_at(self, tokens: int, batch: int = 1, source_tokens: int = 0) -> int:
        """The cache of `batch` sequences of `tokens` positions (and `source_tokens` encoder positions)."""
        return batch * (tokens * self.bytes_per_token + source_tokens * self.cross_bytes_per_source_token)


def language_model(model: nn.Module) -> nn.Module:
    """The module that decodes: a vision-language model's language model, else the model itself."""
    return getattr(model, "language_model", model)


def _heads(config: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads, head width) of a TransformerConfig."""
    heads = config.n_heads
    return heads, config.n_kv_heads or heads, config.head_dim or config.d_model // heads


def _layout(heads: int, kv_heads: int) -> str:
    return "MHA" if kv_heads == heads else "MQA" if kv_heads == 1 else "GQA"


def kv_cache_size(model: nn.Module, dtype: torch.dtype | None = None) -> KVCacheSize | None:
    """The KV cache `model` decodes with (model.make_cache), computed from its config; dtype: the cache's
    (default: the model's floating-point parameters', as make_cache takes it). None for a model that caches
    no keys and values (an encoder, a classifier, an LSTM)."""
    lm = language_model(model)
    if not isinstance(lm, TransformerDecoderModel):
        return None
    c = lm.config
    dtype = dtype or next(p.dtype for p in lm.parameters() if p.is_floating_point())
    heads, kv_heads, hd = _heads(c)
    if isinstance(lm, Seq2SeqModel):
        layers = c.n_decoder_layers
        context = getattr(c, "n_text_ctx", None) or c.context_length
        source = getattr(c, "n_audio_ctx", None) or c.context_length
        per = 2 * kv_heads * hd
        return KVCacheSize(_layout(heads, kv_heads), layers, f"K and V: 2 x {kv_heads} heads x {hd}",
                           layers * per, dtype, context, layers * per, source)
    mla = getattr(c, "mla", None)
    if mla is not None and mla.enabled:
        width = mla.kv_lora_rank + mla.qk_rope_head_dim
        what = f"latent {mla.kv_lora_rank} + rotary key {mla.qk_rope_head_dim}"
        return KVCacheSize("MLA", c.n_layers, what, c.n_layers * width, dtype, c.context_length)
    return KVCacheSize(_layout(heads, kv_heads), c.n_layers, f"K and V: 2 x {kv_heads} heads x {hd}",
                       c.n_layers * 2 * kv_heads * hd, dtype, c.context_length)


FP32 = 4  # bytes of a float32: the Trainer's default precision, the one this estimate covers


@dataclass(frozen=True)
class TrainMemory:
    """One fp32 AdamW training step's memory, in bytes, for a batch of `batch` sequences of `seq` tokens."""

    batch: int
    seq: int
    weights: int
    gradients: int
    optimizer: int
    activations: int  # everything autograd saves for backward over the whole model
    per_layer: int  # one block's saved activations
    block_inputs: int  # what gradient checkpointing keeps of the blocks: each one's input
    head: int  # the activations outside the blocks (final norm, logits, log-softmax)
    backward_transient: int  # what the backward pass allocates beside them (the logits' gradients)
    block_transient: int  # a block's backward beside its saved tensors (the feed-forward hidden's gradient)

    @property
    def activations_checkpointed(self) -> int:
        """With gradient checkpointing: the blocks' inputs, the head's, one block's recomputed in backward."""
        return self.block_inputs + self.head + self.per_layer

    def peak(self, checkpointing: bool = False) -> int:
        """The step's peak: weights and optimizer state always, then the larger of two moments. At the start
        of backward every activation is alive and the logits' gradients are made; at its end every gradient
        is, with the first block's activations (recomputed, under checkpointing) and its transient. Backward
        frees a block's activations as it makes that block's gradients, so the two never all live at once."""
        acts = self.block_inputs + self.head if checkpointing else self.activations
        start = acts + self.backward_transient
        end = self.gradients + self.per_layer + self.block_transient
        return self.weights + self.optimizer + max(start, end)


def _unique_parameters(model: nn.Module) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for p in model.parameters():
        seen.setdefault(id(p), p)
    return list(seen.values())


def _block_numbers(c: Any, seq: int) -> int:
    """Numbers one block saves per token in training (fp32, the fused or naive backend): the inputs of its
    norms and linears, the attention's q/k/v (rotated copies under RoPE, key/value heads repeated to the query
    heads under GQA/MQA), its output, and the feed-forward's hidden layer (twice: before and after the
    activation; gated: the gate, the up projection, the activation and their product)."""
    heads, kv_heads, hd = _heads(c)
    d, q, kv = c.d_model, heads * hd, kv_heads * hd
    f = c.d_ff or 4 * d
    stats = 2 if c.norm == "layernorm" else 1  # a LayerNorm keeps mean and 1/std per token, RMSNorm 1/rms
    n = 2 * (2 * d + stats)  # two norms: input and output each
    n += q + 2 * kv  # the q/k/v projection's output
    if c.position == "rope":
        n += q + kv  # rotated queries and keys are new tensors
    if kv_heads != heads:
        n += 2 * q  # keys and values repeated to every query head
    n += q  # the attention's output, the output projection's input
    n += heads if c.attention == "fused" else heads * seq  # log-sum-exp per head, or the probabilities
    gated = c.ffn.endswith("glu")
    n += 4 * f if gated else 2 * f
    return n


def _dropout_bytes(c: Any, seq: int) -> int:
    """Bytes per token and block of dropout masks (one byte per element): after attention and after the
    feed-forward, and on the probabilities (naive backend)."""
    heads = c.n_heads
    resid = 2 * c.d_model if c.dropout > 0 else 0
    probs = heads * seq * (FP32 + 1) if c.attn_dropout > 0 and c.attention == "naive" else 0
    return resid + probs


def train_memory(model: nn.Module, batch: int, seq: int) -> TrainMemory:
    """The estimate for a GPT-family language model (dense feed-forward, MHA/GQA/MQA attention) trained in
    fp32 with AdamW, from its config and parameter count."""
    if batch < 1 or seq < 1:
        raise ConfigError(f"--batch and --seq must be at least 1, got {batch} and {seq}")
    if not isinstance(model, GPT):
        raise ConfigError(f"the training estimate covers GPT-family language models; this is a "
                          f"{type(model).__name__}")
    c = model.config
    if c.mla.enabled or c.moe.n_experts:
        what = "multi-head latent attention" if c.mla.enabled else "mixture-of-experts blocks"
        raise ConfigError(f"the training estimate covers dense attention and feed-forward blocks; this model "
                          f"has {what}")
    if c.context_length and seq > c.context_length and c.position in ("learned", "sinusoidal"):
        raise ConfigError(f"--seq {seq} is longer than the model's context_length {c.context_length}")
    params = _unique_parameters(model)
    trainable = [p for p in params if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.numel() * p.element_size() for p in trainable)
    tokens = batch * seq
    per_layer = tokens * (_block_numbers(c, seq) * FP32 + _dropout_bytes(c, seq))
    logits = tokens * c.vocab_size * FP32
    stats = 2 if c.norm == "layernorm" else 1
    # the final norm's input and output, the logits and their log-softmax (the loss keeps it), the token ids
    head = tokens * (2 * c.d_model + stats) * FP32 + 2 * logits + tokens * 8
    block_inputs = c.n_layers * tokens * c.d_model * FP32
    ffn_hidden = tokens * (c.d_ff or 4 * c.d_model) * FP32
    return TrainMemory(batch, seq, weights, grads, ADAM_MOMENTS * grads,
                       activations=c.n_layers * per_layer + head, per_layer=per_layer,
                       block_inputs=block_inputs, head=head, backward_transient=2 * logits,
                       block_transient=ffn_hidden)


class LiveTensorBytes(TorchDispatchMode):
    """The bytes of tensor storage alive, and their peak, while the mode is active: every storage an operator
    returns is counted once, until Python or autograd frees it (a weak reference's callback). `hold(tensors)`
    counts storages made before the mode started (the weights, the optimizer's state). Views and in-place
    results share their storage and are not counted again. Scratch memory inside a kernel is not seen: this
    measures tensors, the quantity the estimate predicts."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}  # id of a storage's Python object -> its bytes

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            self._count(t.untyped_storage())

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._live or storage.device.type == "meta":
            return
        size = storage.nbytes()
        self._live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            self._count(t.untyped_storage())
        return out


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []
