"""What every model family shares: the output object, initialisation, input checks, the LM loss,
save/load of qkv checkpoints, and the stack builder. A family file only assembles these."""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.config import TransformerConfig, to_dict
from qkv.nn.block import Block
from qkv.nn.position import build_position
from qkv.nn.stack import Stack


@dataclass
class ModelOutput:
    logits: Tensor | None = None  # (B, T, vocab) or (B, num_labels)
    loss: Tensor | None = None  # mean over target tokens
    n_targets: Tensor | None = None  # how many target tokens the mean is over (for token-normalised accumulation)
    last_hidden_state: Tensor | None = None  # (B, T, d_model)
    attentions: list[dict[str, Tensor]] | None = None  # decoder (or sole stack) attention weights per layer
    encoder_attentions: list[dict[str, Tensor]] | None = None
    pooled: Tensor | None = None  # (B, d_model) pooled representation where a family has one


def check_token_ids(ids: Tensor, vocab_size: int, what: str = "input_ids") -> None:
    """A clear error instead of an index error deep inside torch.nn.functional.embedding."""
    if ids.dtype not in (torch.int64, torch.int32):  # what nn.Embedding accepts as indices
        raise TypeError(f"{what} must be an integer tensor (int64 or int32), got {ids.dtype}; use .long()")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
        raise ValueError(f"{what} contains token id {bad}, outside the vocabulary [0, {vocab_size})")


def check_length(length: int, context: int, what: str = "sequence") -> None:
    if length > context:
        raise ValueError(f"{what} of length {length} exceeds the model's context of {context} positions")


def token_loss(logits: Tensor, labels: Tensor, label_smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
    """Mean cross-entropy over the target tokens (labels != -100) and their count."""
    n = (labels != -100).sum()
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
        ignore_index=-100, reduction="sum", label_smoothing=label_smoothing,
    )
    return loss / n.clamp_min(1), n


def build_stack(
    cfg: TransformerConfig, n_layers: int, *, max_len: int, causal: bool, cross: bool = False,
    embed_norm: bool = False, position: str | None = None,
) -> Stack:
    """An encoder (causal=False) or decoder (causal=True, cross=True for encoder-decoder) stack."""
    blocks = [Block(cfg.d_model, cfg.n_heads, causal=causal, cross_attention=cross, **cfg.block_kwargs())
              for _ in range(n_layers)]
    pos = build_position(position or cfg.position, d_model=cfg.d_model, n_heads=cfg.n_heads,
                         max_len=max_len, rope_base=cfg.rope_base)
    return Stack(blocks, pos, d_model=cfg.d_model, final_norm=cfg.placement == "pre", norm=cfg.norm,
                 norm_eps=cfg.norm_eps, bias=cfg.bias, embed_norm=embed_norm, dropout=cfg.dropout)


class QKVModel(nn.Module):
    """Base of every family: `config`, init, parameter counts, save/load, generate()."""

    family: ClassVar[str] = ""
    config_class: ClassVar[type] = TransformerConfig

    def __init__(self, config: Any) -> None:
        super().__init__()
        # A config built directly (GPTConfig(...)) or edited after from_dict was never checked.
        validate = getattr(config, "validate", None)
        if validate is not None:
            validate()
        self.config = config

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
                    or name.endswith("cross.out_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * max(1, n_residual_layers)))

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Unique parameters (tied weights counted once)."""
        seen, total = set(), 0
        for p in self.parameters():
            if id(p) in seen or (trainable_only and not p.requires_grad):
                continue
            seen.add(id(p))
            total += p.numel()
        return total

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        for m in self.modules():
            if isinstance(m, Stack):
                m.gradient_checkpointing = enabled

    def make_cache(self, batch_size: int, max_len: int | None = None, *, dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None) -> Any:
        """A preallocated KV cache for this model's decoder stack (`self.decoder`): one slot per decoder
        layer, n_kv_heads heads, `max_len` positions (default: the model's context)."""
        from qkv.nn.cache import StaticCache

        c = self.config
        p = self.lm_head.weight
        return StaticCache(len(self.decoder.blocks), batch_size, c.n_kv_heads or c.n_heads, c.d_model // c.n_heads,
                           max_len or c.context_length, dtype=dtype or p.dtype, device=device or p.device)

    # -- checkpoints -----------------------------------------------------------------------------------
    def save_pretrained(self, path: str | os.PathLike) -> Path:
        """Write config.json + model.safetensors atomically into folder `path`."""
        from qkv.checkpoint import save_model

        return save_model(self, path)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Autoregressive generation; see qkv.generate.generate for the arguments."""
        from qkv.generate import generate  # generation lives above the models layer

        return generate(self, *args, **kwargs)


def config_json(model: QKVModel) -> dict[str, Any]:
    return {"qkv_family": model.family, "config": to_dict(model.config)}


def atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


class Seq2SeqModel(QKVModel):
    """The decoder half shared by the encoder-decoder families (EncoderDecoder, Whisper-like): teacher
    forcing, the (cached) decoding step that qkv.generate calls, the KV cache and the loss. A family adds
    its front end: `encode(inputs, attention_mask, return_attentions) -> (memory, attentions)` and
    `embed_target(ids) -> (B, T, d)`, and holds `self.decoder` (a cross-attending Stack) and `self.lm_head`;
    its config has target_vocab_size, context_length, n_decoder_layers and pad/bos token ids."""

    def embed_target(self, ids: Tensor) -> Tensor:  # pragma: no cover - every family defines it
        raise NotImplementedError

    def decode(self, decoder_input_ids: Tensor, memory: Tensor, *, memory_mask: Tensor | None = None,
               decoder_attention_mask: Tensor | None = None, cache: Any = None,
               offset: int | Tensor | None = None, return_attentions: bool = False, last_only: bool = False):
        """Decoder over `memory` (B, S, d): returns (logits (B, T|1, vocab), StackOutput)."""
        c = self.config
        check_token_ids(decoder_input_ids, c.target_vocab_size, "decoder_input_ids")
        past = cache.length if cache is not None else 0
        check_length(past + decoder_input_ids.shape[1], c.context_length, "target sequence")
        keep = decoder_attention_mask.bool() if decoder_attention_mask is not None else None
        mkeep = memory_mask.bool() if memory_mask is not None else None
        out = self.decoder(self.embed_target(decoder_input_ids), keep=keep, memory=memory, memory_keep=mkeep,
                           cache=cache, offset=offset, return_weights=return_attentions)
        h = out.hidden[:, -1:] if last_only else out.hidden
        return self.lm_head(h), out

    def shift_right(self, labels: Tensor) -> Tensor:
        """Teacher forcing: the decoder sees [bos, y_1, ..., y_{T-1}] and predicts [y_1, ..., y_T]."""
        start = torch.full_like(labels[:, :1], self.config.bos_token_id)
        shifted = torch.cat([start, labels[:, :-1]], dim=1)
        return shifted.masked_fill(shifted == -100, self.config.pad_token_id)

    def seq2seq_forward(self, encoder_inputs: Tensor, *, decoder_input_ids: Tensor | None, labels: Tensor | None,
                        attention_mask: Tensor | None, decoder_attention_mask: Tensor | None,
                        return_attentions: bool) -> ModelOutput:
        """encode -> decode (decoder_input_ids default to labels shifted right) -> token loss."""
        if decoder_input_ids is None:
            if labels is None:
                raise ValueError(f"{type(self).__name__}.forward needs decoder_input_ids or labels")
            decoder_input_ids = self.shift_right(labels)
        memory, enc_att = self.encode(encoder_inputs, attention_mask, return_attentions)
        logits, out = self.decode(decoder_input_ids, memory, memory_mask=attention_mask,
                                  decoder_attention_mask=decoder_attention_mask, return_attentions=return_attentions)
        loss = n = None
        if labels is not None:
            loss, n = token_loss(logits, labels, self.config.label_smoothing if self.training else 0.0)
        return ModelOutput(logits=logits, loss=loss, n_targets=n, last_hidden_state=out.hidden,
                           attentions=out.attentions or None, encoder_attentions=enc_att)
