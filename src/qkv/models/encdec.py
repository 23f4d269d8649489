"""The original Transformer (Vaswani et al. 2017): an encoder-decoder for sequence-to-sequence tasks.

src ids (B, S) -> embed * sqrt(d) -> [position] -> encoder blocks -> memory (B, S, d)
tgt ids (B, T) -> embed * sqrt(d) -> [position] -> decoder blocks (causal self-attn, cross-attn over
memory) -> [final norm, Pre-LN only] -> output projection -> logits (B, T, tgt_vocab)
The paper uses Post-LN, sinusoidal positions, ReLU, dropout 0.1, label smoothing 0.1 and ties the
source/target embeddings and the output projection over a shared vocabulary (section 3.4).

The pretrained encoder-decoders are configurations of the same model (qkv.interop.t5 / .bart load them):
  T5 (v1.0, v1.1 / Flan)  relative position bias (position="relative"), RMS norm, Pre-LN, no biases, no
                          1/sqrt(d_k) (scaled=False), ReLU or gated GELU, head width d_kv (head_dim); a tied
                          head sees the hidden states times d_model**-0.5 (output_scale)
  BART                    learned positions read 2 rows on (position_skip=2), an embedding LayerNorm
                          (embed_norm), GELU, Post-LN, final_logits_bias (logits_bias)
  Marian (OPUS-MT)        sinusoidal positions with sines then cosines (sinusoidal_layout="halves"),
                          embeddings times sqrt(d_model), SiLU ("swish"), Post-LN, final_logits_bias
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from qkv.config import ConfigError, TransformerConfig, setting
from qkv.models.base import ModelOutput, Seq2SeqModel, build_stack
from qkv.models.registry import register_family, register_preset
from qkv.nn.checks import check_batch, check_length, check_token_ids
from qkv.nn.linear import Linear
from qkv.nn.position import SINUSOIDAL_LAYOUTS, Learned, PositionalEncoding, RelativeBias, Sinusoidal


@dataclass
class EncoderDecoderConfig(TransformerConfig):
    src_vocab_size: int = setting(37000, "source (or shared) vocabulary", ge=1)
    tgt_vocab_size: int | None = setting(None, "target vocabulary", ge=0, note="0 = as null",
                                         none="the shared source vocabulary")
    n_encoder_layers: int = setting(6, "encoder blocks")
    n_decoder_layers: int = setting(6, "decoder blocks")
    context_length: int = setting(512, "longest source or target sequence", ge=1)
    share_embeddings: bool = setting(True, "tie source, target and output embeddings (needs a shared "
                                     "vocabulary)")
    scale_embeddings: bool = setting(True, "multiply embeddings by sqrt(d_model) (section 3.4)")
    label_smoothing: float = setting(0.1, "of the training cross-entropy", ge=0, lt=1)
    pad_token_id: int = setting(0, "padding token")
    bos_token_id: int = setting(1, "decoder start token")
    eos_token_id: int = setting(2, "end-of-sequence token")
    d_model: int = TransformerConfig.override("d_model", 512)
    n_heads: int = TransformerConfig.override("n_heads", 8)
    d_ff: int | None = TransformerConfig.override("d_ff", 2048)
    ffn: str = TransformerConfig.override("ffn", "relu")
    position: str = TransformerConfig.override("position", "sinusoidal")
    placement: str = TransformerConfig.override("placement", "post")
    dropout: float = TransformerConfig.override("dropout", 0.1)
    # -- the pretrained layouts (T5, BART, Marian); the defaults are the paper's model ------------------
    tie_output: bool | None = setting(None, "output projection = target embedding",
                                      none="as share_embeddings")
    output_scale: float = setting(1.0, "hidden states x this before the output projection (T5 tied: "
                                  "d_model**-0.5)", gt=0)
    logits_bias: bool = setting(False, "a (1, vocab) bias added to the logits (BART / Marian "
                                "final_logits_bias)")
    embed_norm: bool = setting(False, "LayerNorm after embeddings + positions, in both stacks (BART)")
    position_skip: int = setting(0, "learned positions: position p reads row p + skip (BART: 2)", ge=0)
    sinusoidal_layout: str = setting("interleaved", "interleaved (Vaswani) or halves (sines then cosines: "
                                     "Marian)", choices=SINUSOIDAL_LAYOUTS)
    relative_buckets: int = setting(32, "position=relative (T5): buckets of key-query distances", ge=2)
    relative_max_distance: int = setting(128, "... and the distance from which they all share the last "
                                         "bucket", ge=2)

    @property
    def target_vocab_size(self) -> int:
        return self.tgt_vocab_size or self.src_vocab_size

    def validate(self) -> None:
        super().validate()
        if self.share_embeddings and self.tgt_vocab_size not in (None, self.src_vocab_size):
            raise ConfigError("share_embeddings needs one vocabulary: set tgt_vocab_size=null or "
                              "share_embeddings=false")

    def position_encoding(self) -> PositionalEncoding | None:
        """The encoding object for a non-default layout (None: build_stack's default from `position`)."""
        if self.position == "relative":
            return RelativeBias(self.n_heads, self.relative_buckets, self.relative_max_distance)
        if self.position == "learned" and self.position_skip:
            return Learned(self.d_model, self.context_length, skip=self.position_skip)
        if self.position == "sinusoidal" and self.sinusoidal_layout != "interleaved":
            return Sinusoidal(self.d_model, self.context_length, layout=self.sinusoidal_layout)
        return None


class OutputHead(Linear):
    """The output projection with T5's input scaling and BART / Marian's final_logits_bias (a buffer, as in
    Hugging Face: saved, not trained): logits = (h * scale) W^T + final_logits_bias."""

    def __init__(self, d_model: int, vocab: int, scale: float = 1.0, logits_bias: bool = False) -> None:
        super().__init__(d_model, vocab, bias=False)
        self.scale = scale
        self.register_buffer("final_logits_bias", torch.zeros(1, vocab) if logits_bias else None)

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x * self.scale if self.scale != 1.0 else x)
        return y if self.final_logits_bias is None else y + self.final_logits_bias


class EncoderDecoder(Seq2SeqModel):
    kinds: ClassVar[tuple[str, ...]] = ("seq2seq",)

    @classmethod
    def config_for_task(cls, kind: str, needs: dict[str, Any]) -> dict[str, Any]:
        """A task's one vocabulary is the shared source/target vocabulary."""
        out = dict(needs)
        if "vocab_size" in out:
            out["src_vocab_size"], out["tgt_vocab_size"] = out.pop("vocab_size"), None
        return out

    def __init__(self, config: EncoderDecoderConfig) -> None:
        super().__init__(config)
        c = config
        self.src_emb = nn.Embedding(c.src_vocab_size, c.d_model)
        self.tgt_emb = nn.Embedding(c.target_vocab_size, c.d_model)
        stack = dict(max_len=c.context_length, embed_norm=c.embed_norm)
        self.encoder = build_stack(c, c.n_encoder_layers, causal=False,
                                   position=c.position_encoding(), **stack)
        self.decoder = build_stack(c, c.n_decoder_layers, causal=True, cross=True,
                                   position=c.position_encoding(), **stack)
        if c.output_scale != 1.0 or c.logits_bias:
            self.lm_head = OutputHead(c.d_model, c.target_vocab_size, c.output_scale, c.logits_bias)
        else:
            self.lm_head = Linear(c.d_model, c.target_vocab_size, bias=False)
        self.init_weights(c.n_encoder_layers + c.n_decoder_layers)
        if c.share_embeddings:
            self.tgt_emb.weight = self.src_emb.weight
        if c.share_embeddings if c.tie_output is None else c.tie_output:
            self.lm_head.weight = self.tgt_emb.weight
        self.embed_scale = math.sqrt(c.d_model) if c.scale_embeddings else 1.0

    def encode(self, input_ids: Tensor, attention_mask: Tensor | None = None,
               return_attentions: bool = False) -> tuple[Tensor, list | None]:
        c = self.config
        check_batch(input_ids)
        check_token_ids(input_ids, c.src_vocab_size)
        # only absolute encodings (learned, sinusoidal) limit the source; RoPE / ALiBi / none take any length
        check_length(input_ids.shape[1], self.encoder.context_limit, "source sequence")
        keep = attention_mask.bool() if attention_mask is not None else None
        out = self.encoder(self.src_emb(input_ids) * self.embed_scale, keep=keep,
                           return_weights=return_attentions)
        return out.hidden, out.attentions or None

    def check_source(self, inputs: Tensor) -> None:
        check_token_ids(inputs, self.config.src_vocab_size, entry=True)

    def embed_target(self, ids: Tensor) -> Tensor:
        return self.tgt_emb(ids) * self.embed_scale

    def forward(
        self,
        input_ids: Tensor,
        *,
        decoder_input_ids: Tensor | None = None,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
        decoder_attention_mask: Tensor | None = None,
        return_attentions: bool = False,
    ) -> ModelOutput:
        """input_ids: source (B, S); labels: target (B, T) with -100 on padding; decoder_input_ids default
        to labels shifted right. Masks: (B, S) / (B, T), 1 = real token."""
        return self.seq2seq_forward(input_ids, decoder_input_ids=decoder_input_ids, labels=labels,
                                    attention_mask=attention_mask,
                                    decoder_attention_mask=decoder_attention_mask,
                                    return_attentions=return_attentions)


register_family("encdec", EncoderDecoderConfig, EncoderDecoder)
register_preset("transformer-base", "encdec", EncoderDecoderConfig(),
                "the paper's base model: 6+6 layers, 512 wide, 8 heads, shared 37k vocabulary, Post-LN")
register_preset("transformer-big", "encdec",
                EncoderDecoderConfig(d_model=1024, n_heads=16, d_ff=4096, dropout=0.3),
                "the paper's big model")
register_preset("transformer-tiny", "encdec", EncoderDecoderConfig(
    src_vocab_size=64, n_encoder_layers=2, n_decoder_layers=2, d_model=128, n_heads=4, d_ff=512,
    context_length=64, dropout=0.0, label_smoothing=0.0, placement="pre"),
    "2+2 layers, 128 wide, Pre-LN: toy seq2seq tasks on CPU")
