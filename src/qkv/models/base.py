"""What every model family shares: the output object, initialisation, the LM loss, the stack builder,
save/generate conveniences, the family's kind, and the decoder half of the encoder-decoder families.
A family file only assembles these."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.config import TransformerConfig
from qkv.models.decoding import Source
from qkv.nn.block import Block
from qkv.nn.cache import StaticCache
from qkv.nn.checks import check_batch, check_length, check_token_ids
from qkv.nn.paged import PagedKVCache
from qkv.nn.params import count_parameters
from qkv.nn.position import PositionalEncoding, build_position
from qkv.nn.quant import quantized_layers
from qkv.nn.stack import Stack
from qkv.storage import save_model


@dataclass
class ModelOutput:
    logits: Tensor | None = None  # (B, T, vocab) or (B, num_labels)
    loss: Tensor | None = None  # mean over target tokens
    # how many target tokens the mean is over (for token-normalised accumulation)
    n_targets: Tensor | None = None
    last_hidden_state: Tensor | None = None  # (B, T, d_model)
    attentions: list[dict[str, Tensor]] | None = None  # decoder (or sole stack) attention weights per layer
    encoder_attentions: list[dict[str, Tensor]] | None = None
    pooled: Tensor | None = None  # (B, d_model) pooled representation where a family has one
    # a training forward's auxiliary loss (MoE load balancing), logged by the Trainer
    aux_loss: Tensor | None = None


def token_loss(logits: Tensor, labels: Tensor, label_smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
    """Mean cross-entropy over the target tokens (labels != -100) and their count."""
    n = (labels != -100).sum()
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
        ignore_index=-100, reduction="sum", label_smoothing=label_smoothing,
    )
    return loss / n.clamp_min(1), n


def class_logits(classifier: nn.Module | None, dropout: nn.Module, pooled: Tensor,
                 labels: Tensor | None) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """An image classifier's head on pooled (B, d) features: (logits, loss, n_targets), each None where there
    is no classifier or no labels; labels are (B,) class ids."""
    if classifier is None:
        return None, None, None
    logits = classifier(dropout(pooled))
    if labels is None:
        return logits, None, None
    if labels.shape != (pooled.shape[0],):
        raise ValueError(f"labels must be (B,) class ids, got shape {tuple(labels.shape)}")
    return (logits, *token_loss(logits, labels))


def build_stack(
    cfg: TransformerConfig, n_layers: int, *, max_len: int, causal: bool, cross: bool = False,
    embed_norm: bool = False, position: str | PositionalEncoding | None = None,
) -> Stack:
    """An encoder (causal=False) or decoder (causal=True, cross=True for encoder-decoder) stack. position:
    the config's encoding by default, another name, or an encoding object (ViT's patch grid, Whisper's
    audio table)."""
    blocks = [Block(cfg.d_model, cfg.n_heads, causal=causal, cross_attention=cross, **cfg.block_kwargs(),
                    **cfg.layer_kwargs(i)) for i in range(n_layers)]
    if isinstance(position, PositionalEncoding):
        pos = position
    else:
        pos = build_position(position or cfg.position, d_model=cfg.d_model, n_heads=cfg.n_heads,
                             max_len=max_len, rope_base=cfg.rope_base,
                             rope_scaling=cfg.rope_scaling, head_dim=cfg.head_dim)
    return Stack(blocks, pos, d_model=cfg.d_model, final_norm=cfg.placement == "pre", norm=cfg.norm,
                 norm_eps=cfg.norm_eps, bias=cfg.bias, embed_norm=embed_norm, dropout=cfg.dropout)


class QKVModel(nn.Module):
    """Base of every family: `config`, its kinds, init, parameter counts, save_pretrained, generate()."""

    family: ClassVar[str] = ""
    config_class: ClassVar[type] = TransformerConfig
    # The kinds of task this family serves (registry.KINDS), its main kind first. A task built for a family
    # takes the first of these kinds that it supports, and shapes its batches and config by that kind alone.
    kinds: ClassVar[tuple[str, ...]] = ()
    # a sequence classifier that reads the first position (BERT's [CLS]): tasks put such a token there
    pools_first_token: ClassVar[bool] = False
    # state-dict names that moved: old -> new; checkpoints written before the move still load (qkv.storage)
    renamed_keys: ClassVar[dict[str, str]] = {}

    def __init__(self, config: Any) -> None:
        super().__init__()
        # A config built directly (GPTConfig(...)) or edited after from_dict was never checked.
        validate = getattr(config, "validate", None)
        if validate is not None:
            validate()
        self.config = config
        self.folder_generation_config: dict[str, Any] = {}  # a loaded folder's generation_config.json

    @property
    def kind(self) -> str:
        return self.kinds[0]

    @classmethod
    def config_for_task(cls, kind: str, needs: dict[str, Any]) -> dict[str, Any]:
        """This family's config fields for a task of `kind` that needs `needs`, given in the shared names
        (vocab_size, context_length, num_labels, pad/bos/eos_token_id, and a kind's own fields: image_size,
        n_channels for images; the audio front end's for audio). Default: the names are this family's own."""
        return dict(needs)

    def init_weights(self, n_residual_layers: int) -> None:
        """Normal(0, init_std) for linears, Normal(0, embed_init_std) for embeddings, zero biases, and
        GPT-2's scaling of residual output projections by 1/sqrt(2 * n_layers) (Radford et al. 2019)."""
        std = self.config.init_std
        estd = self.config.embed_init_std if self.config.embed_init_std is not None else std
        for name, p in self.named_parameters():
            if p.dim() < 2:
                if name.endswith(".bias"):
                    nn.init.zeros_(p)
                continue
            is_embedding = "emb" in name or name.endswith("position.weight")
            nn.init.normal_(p, mean=0.0, std=estd if is_embedding else std)
            if name.endswith("attn.out_proj.weight") or name.endswith("ffn.down.weight") \
                    or (".ffn." in name and name.endswith(".down.weight")) \
                    or name.endswith("cross.out_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * max(1, n_residual_layers)))

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Unique parameters (tied weights counted once)."""
        return count_parameters(self, trainable_only)

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        for m in self.modules():
            if isinstance(m, Stack):
                m.gradient_checkpointing = enabled

    def save_pretrained(self, path: str | os.PathLike) -> Path:
        """Write config.json + model.safetensors atomically into folder `path` (qkv.storage.save_model)."""
        if quantized_layers(self):  # its integer buffers would make a folder no loader reads
            raise ValueError("a weight-only quantized model is not saved: save the unquantized model and "
                             "quantize it when loading (qkv.from_pretrained(folder, quantize=...))")
        return save_model(self, path)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Autoregressive generation; see qkv.generate.generate for the arguments."""
        # The one upward import of the models layer (allow-listed in tests/nn/test_layering.py): the HF-style
        # model.generate(...) convenience. Generation itself consumes only the decoder protocol.
        from qkv.generate import generate  # noqa: PLC0415  (the one upward import (tests/nn/test_layering.py): model.generate() convenience)

        return generate(self, *args, **kwargs)


class TransformerDecoderModel(QKVModel):
    """The decoder protocol (models/decoding.py) for families whose decoder is a qkv Stack `self.decoder`
    under an output projection `self.lm_head`: caches sized from the stack, the context limit of its
    positions, the fast step through Stack.step. A family adds `embed_target(ids)` (its token embedding),
    `output_vocab_size`, `encode_source` and `prefill`."""

    is_seq2seq: ClassVar[bool] = False

    def embed_target(self, ids: Tensor) -> Tensor:  # pragma: no cover - every family defines it
        raise NotImplementedError

    @property
    def context_limit(self) -> int | None:
        """Most decoder positions: an absolute table's length; None for RoPE / ALiBi / none."""
        return self.decoder.context_limit

    def generation_defaults(self) -> dict[str, Any]:
        c = self.config
        out = {k: getattr(c, k) for k in ("eos_token_id", "pad_token_id", "bos_token_id")
                   if getattr(c, k, None) is not None}
        if self.is_seq2seq and "bos_token_id" in out:
            out["decoder_start_token_id"] = out["bos_token_id"]
        return {**out, **self.folder_generation_config}

    def _float_param(self) -> Tensor:
        """What gives the caches their dtype and device: the output projection's weight, or, where that holds
        integer codes (a weight-only quantized head, qkv.nn.quant), the model's first parameter."""
        w = getattr(self.lm_head, "weight", None)
        return w if isinstance(w, Tensor) and w.is_floating_point() else next(self.parameters())

    def _cache_shape(self) -> tuple[int, int, int]:
        a = self.decoder.blocks[0].attn
        return len(self.decoder.blocks), a.n_kv_heads, a.head_dim

    def make_cache(self, batch_size: int, max_len: int | None = None, *, dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None) -> StaticCache:
        """A preallocated KV cache for the decoder stack: one slot per layer, n_kv_heads heads, `max_len`
        positions (default: the model's context_length)."""
        p = self._float_param()
        n_layers, n_kv, hd = self._cache_shape()
        return StaticCache(n_layers, batch_size, n_kv, hd, max_len or self.config.context_length,
                           dtype=dtype or p.dtype, device=device or p.device)

    def make_paged_cache(self, num_blocks: int | None = None, block_size: int = 16, *,
                         max_batch_size: int = 1,
                         dtype: torch.dtype | None = None,
                         device: torch.device | str | None = None) -> PagedKVCache:
        """A pool of num_blocks blocks of block_size positions for the decoder stack (serving); by default
        enough for max_batch_size sequences of the model's context_length."""
        p = self._float_param()
        n_layers, n_kv, hd = self._cache_shape()
        if num_blocks is None:
            num_blocks = max_batch_size * -(-self.config.context_length // block_size)
        return PagedKVCache(n_layers, n_kv, hd, num_blocks, block_size, dtype=dtype or p.dtype,
                            device=device or p.device)

    def step(self, ids: Tensor, cache: Any, *, keep: Tensor | None = None,
             offset: int | Tensor | None = None, all_logits: bool = False) -> Tensor:
        """Next-token logits (B, V) after the newest ids (B, T) over a filled cache: the decoder stack's fast
        path (Stack.step, for the last token only: the others' outputs are not read) and the output
        projection's (Linear.step). all_logits=True: every new position's logits (B, T, V), for the
        log-probabilities of a prompt's own tokens (the serving Engine's prompt_logprobs)."""
        h = self.decoder.step(self.embed_target(ids), cache=cache, keep=keep, offset=offset,
                              last_only=not all_logits)
        return self.lm_head(h) if all_logits else self.lm_head(h[:, -1])

    def verify(self, ids: Tensor, cache: Any, *, keep: Tensor | None = None,
               offset: int | Tensor | None = None, n_logits: int = 1) -> Tensor:
        """Logits (B, n_logits, V) of the last n_logits of the newest ids (B, T) over a cache (filled or
        empty): speculative decoding (qkv.generate.speculative) checks n_logits - 1 drafted tokens in one
        forward, reading the weights once for all of them. Advances the cache by T; the caller crops it back
        (StaticCache.crop) past the first rejected draft."""
        h = self.decoder.step(self.embed_target(ids), cache=cache, keep=keep, offset=offset)
        return self.lm_head(h[:, -n_logits:])

    @property
    def static_step_supported(self) -> bool:
        """Whether static_step (graph-captured decoding) works for this model's positions."""
        return self.decoder.static_step_supported

    def static_step(self, ids: Tensor, cache: StaticCache, *, index: Tensor, offset: Tensor,
                    keep: Tensor | None = None) -> Tensor:
        """step() for one new token per row (ids (B, 1)) with shapes that never change, for torch.compile /
        CUDA graphs (Stack.static_step: the arguments, and the caller advances cache.length)."""
        h = self.decoder.static_step(self.embed_target(ids), cache=cache, index=index,
                                     offset=offset, keep=keep)
        return self.lm_head(h[:, -1])


class Seq2SeqModel(TransformerDecoderModel):
    """The decoder half shared by the encoder-decoder families (EncoderDecoder, Whisper-like): teacher
    forcing, the (cached) decoding that qkv.generate calls through the decoder protocol, the loss. A family
    adds its front end: `encode(inputs, attention_mask, return_attentions) -> (memory, attentions)`,
    `check_source(inputs)` and `embed_target(ids) -> (B, T, d)`, and holds `self.decoder` (a cross-attending
    Stack) and `self.lm_head`; its config has target_vocab_size, context_length, n_decoder_layers and
    pad/bos token ids."""

    is_seq2seq: ClassVar[bool] = True

    @property
    def output_vocab_size(self) -> int:
        return self.config.target_vocab_size

    def check_source(self, inputs: Tensor) -> None:
        """Validate a generation input where it enters (token ids: their range, once)."""

    def encode_source(self, inputs: Tensor, attention_mask: Tensor | None = None) -> Source:
        self.check_source(inputs)
        if (attention_mask is not None and attention_mask.dim() == 2
            and bool((attention_mask == 0).all(1).any())):
            # its cross-attention would see no key: a softmax over nothing (as a decoder-only prompt of
            # padding)
            raise ValueError("a source in the batch is all padding (attention_mask row of zeros)")
        memory, _ = self.encode(inputs, attention_mask)
        return Source(memory, attention_mask)

    def prefill(self, ids: Tensor, cache: Any, *, keep: Tensor | None = None,
                offset: int | Tensor | None = None,
                source: Source | None = None, return_attentions: bool = False) -> tuple[Tensor, list | None]:
        if source is None:
            raise ValueError(f"{type(self).__name__} decodes from an encoded source: pass "
                             "source=encode_source(...)")
        logits, out = self.decode(ids, source.memory, memory_mask=source.mask, decoder_attention_mask=keep,
                                  cache=cache, offset=offset,
                                  return_attentions=return_attentions, last_only=True)
        return logits[:, -1], out.attentions

    def decode(self, decoder_input_ids: Tensor, memory: Tensor, *, memory_mask: Tensor | None = None,
               decoder_attention_mask: Tensor | None = None, cache: Any = None,
               offset: int | Tensor | None = None, return_attentions: bool = False, last_only: bool = False):
        """Decoder over `memory` (B, S, d): returns (logits (B, T|1, vocab), StackOutput); with last_only the
        StackOutput's hidden states are the last position's only (Stack.forward)."""
        check_batch(decoder_input_ids, "decoder_input_ids")
        check_token_ids(decoder_input_ids, self.config.target_vocab_size, "decoder_input_ids")
        past = cache.length if cache is not None else 0
        check_length(past + decoder_input_ids.shape[1], self.context_limit, "target sequence")
        keep = decoder_attention_mask.bool() if decoder_attention_mask is not None else None
        mkeep = memory_mask.bool() if memory_mask is not None else None
        out = self.decoder(self.embed_target(decoder_input_ids), keep=keep, memory=memory, memory_keep=mkeep,
                           cache=cache, offset=offset, return_weights=return_attentions, last_only=last_only)
        h = out.hidden[:, -1:] if last_only else out.hidden
        return self.lm_head(h), out

    def shift_right(self, labels: Tensor) -> Tensor:
        """Teacher forcing: the decoder sees [bos, y_1, ..., y_{T-1}] and predicts [y_1, ..., y_T]."""
        start = torch.full_like(labels[:, :1], self.config.bos_token_id)
        shifted = torch.cat([start, labels[:, :-1]], dim=1)
        return shifted.masked_fill(shifted == -100, self.config.pad_token_id)

    def seq2seq_forward(self, encoder_inputs: Tensor, *, decoder_input_ids: Tensor | None,
                        labels: Tensor | None,
                        attention_mask: Tensor | None, decoder_attention_mask: Tensor | None,
                        return_attentions: bool) -> ModelOutput:
        """encode -> decode (decoder_input_ids default to labels shifted right) -> token loss."""
        if decoder_input_ids is None:
            if labels is None:
                raise ValueError(f"{type(self).__name__}.forward needs decoder_input_ids or labels")
            decoder_input_ids = self.shift_right(labels)
        memory, enc_att = self.encode(encoder_inputs, attention_mask, return_attentions)
        logits, out = self.decode(decoder_input_ids, memory, memory_mask=attention_mask,
                                  decoder_attention_mask=decoder_attention_mask,
                                  return_attentions=return_attentions)
        loss = n = None
        if labels is not None:
            loss, n = token_loss(logits, labels, self.config.label_smoothing if self.training else 0.0)
        return ModelOutput(logits=logits, loss=loss, n_targets=n, last_hidden_state=out.hidden,
                           attentions=out.attentions or None, encoder_attentions=enc_att)
