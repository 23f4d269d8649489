"""GPT: a decoder-only causal language model (Radford et al. 2018/2019).

token ids (B, T) -> token embedding -> [position.embed] -> N causal Pre-LN blocks -> final norm
-> LM head (tied to the token embedding) -> logits (B, T, vocab). Loss: next-token cross-entropy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import Tensor, nn

from qkv.config import ConfigError, TransformerConfig, check_mla, check_moe, check_moe_memory
from qkv.models.base import ModelOutput, TransformerDecoderModel, build_stack, token_loss
from qkv.models.decoding import Source
from qkv.models.registry import register_family, register_preset
from qkv.nn.checks import check_batch, check_labels, check_length, check_token_ids
from qkv.nn.linear import Linear
from qkv.nn.mla import LatentCache, MLAConfig
from qkv.nn.moe import MoEConfig, moe_aux_loss, update_router_biases
from qkv.nn.paged_latent import PagedLatentCache


@dataclass
class GPTConfig(TransformerConfig):
    vocab_size: int = 65  # token vocabulary
    n_layers: int = 4  # decoder blocks
    context_length: int = 256  # longest sequence (positions) the model accepts
    tie_embeddings: bool = True  # share the token embedding with the LM head (Press & Wolf 2017)
    # mixture-of-experts blocks (nn/moe.py); n_experts=0: none
    moe: MoEConfig = field(default_factory=MoEConfig)
    # multi-head latent attention (nn/mla.py); kv_lora_rank=0: none
    mla: MLAConfig = field(default_factory=MLAConfig)

    def validate(self) -> None:
        super().validate()
        if self.vocab_size < 1 or self.n_layers < 1 or self.context_length < 1:
            raise ConfigError("vocab_size, n_layers and context_length must be positive")
        check_moe(self.moe, self.n_layers)
        check_mla(self)

    def layer_kwargs(self, layer: int) -> dict[str, Any]:
        kw: dict[str, Any] = {"moe": self.moe} if self.moe.is_moe(layer) else {}
        return {**kw, "mla": self.mla} if self.mla.enabled else kw


class GPT(TransformerDecoderModel):
    kinds: ClassVar[tuple[str, ...]] = ("decoder",)

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        c = config
        # here, not in validate(): a folder's weights file bounds the expert count first, with a message that
        # names what the file holds (qkv.folder_sizes); this bounds a model built from a config alone
        check_moe_memory(c.moe, c.n_layers, c.d_model, c.d_ff or 4 * c.d_model)
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.decoder = build_stack(c, c.n_layers, max_len=c.context_length, causal=True)
        self.lm_head = Linear(c.d_model, c.vocab_size, bias=False)
        self.init_weights(c.n_layers)
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def forward(
        self,
        input_ids: Tensor,
        *,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: Any = None,
        offset: int | Tensor | None = None,
        return_attentions: bool = False,
        last_only: bool = False,
    ) -> ModelOutput:
        """input_ids: (B, T). labels: (B, T), shifted inside (predict labels[t+1] at t), -100 = ignore.
        attention_mask: (B, Tk) 1 for real tokens, 0 for padding, over cached + new tokens.
        last_only: compute logits for the last position only (generation); the top block then does only the
        work that position needs (its keys and values still cover, and fill the cache for, every position),
        and last_hidden_state is that position's (B, 1, d) unless return_attentions is set."""
        c = self.config
        check_batch(input_ids)
        check_token_ids(input_ids, c.vocab_size)
        if labels is not None:
            check_labels(labels, input_ids)
        past = cache.length if cache is not None else 0
        check_length(past + input_ids.shape[1], self.context_limit)  # only absolute positions have a limit
        x = self.tok_emb(input_ids)  # (B, T, d)
        keep = attention_mask.bool() if attention_mask is not None else None
        out = self.decoder(x, keep=keep, cache=cache, offset=offset, return_weights=return_attentions,
                           last_only=last_only)
        h = out.hidden[:, -1:] if last_only else out.hidden
        logits = self.lm_head(h)  # (B, T, vocab)
        loss = n = None
        if labels is not None:
            loss, n = token_loss(logits[:, :-1], labels[:, 1:])
        aux = moe_aux_loss(self) if self.training and c.moe.n_experts else None
        if aux is not None and loss is not None and c.moe.aux_loss_coef:
            loss = loss + c.moe.aux_loss_coef * aux
        return ModelOutput(logits=logits, loss=loss, n_targets=n, last_hidden_state=out.hidden,
                           attentions=out.attentions or None, aux_loss=aux)

    def after_update(self) -> None:
        """Called by the Trainer after each optimizer update: the bias-balanced routers move their biases."""
        if self.config.moe.bias_balance:
            update_router_biases(self)

    # -- the decoder protocol (models/decoding.py); step() and the caches come from TransformerDecoderModel
    @property
    def context_limit(self) -> int | None:
        """The positions' limit (an absolute table's length), and a sliding window's span: attention limited
        to the last `sliding_window` keys is not implemented, so a longer sequence is refused, never attended
        in full (which would silently compute another function)."""
        limit, window = self.decoder.context_limit, self.config.sliding_window
        return limit if window is None else min(window, limit or window)

    def make_cache(self, batch_size: int, max_len: int | None = None, *, dtype: Any = None,
                   device: Any = None) -> Any:
        """An MLA model caches the compressed latent and rotary key per token (nn/mla.py's LatentCache)."""
        m = self.config.mla
        if not m.enabled:
            return super().make_cache(batch_size, max_len, dtype=dtype, device=device)
        p = self._float_param()
        return LatentCache(self.config.n_layers, batch_size, m.kv_lora_rank, m.qk_rope_head_dim,
                           max_len or self.config.context_length, dtype=dtype or p.dtype,
                           device=device or p.device)

    def make_paged_cache(self, num_blocks: int | None = None, block_size: int = 16, *,
                         max_batch_size: int = 1, dtype: Any = None, device: Any = None) -> Any:
        """An MLA model's pool holds the latent and rotary key per token (nn/paged_latent.py)."""
        m = self.config.mla
        if not m.enabled:
            return super().make_paged_cache(num_blocks, block_size, max_batch_size=max_batch_size,
                                            dtype=dtype, device=device)
        p = self._float_param()
        num_blocks = num_blocks or max_batch_size * -(-self.config.context_length // block_size)
        return PagedLatentCache(self.config.n_layers, m.kv_lora_rank, m.qk_rope_head_dim, num_blocks,
                                block_size, dtype=dtype or p.dtype, device=device or p.device)

    @property
    def output_vocab_size(self) -> int:
        return self.config.vocab_size

    def embed_target(self, ids: Tensor) -> Tensor:
        return self.tok_emb(ids)

    def encode_source(self, inputs: Tensor, attention_mask: Tensor | None = None) -> Source | None:
        """A decoder-only model has no encoder: this only checks the prompt ids, once, where they enter."""
        check_token_ids(inputs, self.config.vocab_size, entry=True)
        return None

    def prefill(self, ids: Tensor, cache: Any, *, keep: Tensor | None = None,
                offset: int | Tensor | None = None,
                source: Source | None = None, return_attentions: bool = False) -> tuple[Tensor, list | None]:
        out = self(ids, attention_mask=keep, cache=cache, offset=offset, return_attentions=return_attentions,
                   last_only=True)
        return out.logits[:, -1], out.attentions


register_family("gpt", GPTConfig, GPT)
register_preset("gpt2", "gpt", GPTConfig(
    vocab_size=50257, n_layers=12, d_model=768, n_heads=12, context_length=1024, ffn="gelu_tanh",
    position="learned", placement="pre"), "GPT-2 small, 124M (Radford et al. 2019)")
register_preset("gpt2-medium", "gpt", GPTConfig(
    vocab_size=50257, n_layers=24, d_model=1024, n_heads=16, context_length=1024, ffn="gelu_tanh"),
    "GPT-2 medium, 355M")
register_preset("gpt-bench", "gpt", GPTConfig(
    vocab_size=65, n_layers=6, d_model=384, n_heads=6, context_length=256, ffn="gelu_tanh"),
    "nanoGPT shakespeare_char size (6L/6H/384, block 256): the benchmark model")
register_preset("gpt-tiny", "gpt", GPTConfig(
    vocab_size=256, n_layers=4, d_model=128, n_heads=4, context_length=64, ffn="gelu_tanh"),
    "4 layers, 4 heads, 128 wide, context 64: trains on a laptop CPU in minutes")
register_preset("gpt-nano", "gpt", GPTConfig(
    vocab_size=16, n_layers=3, d_model=48, n_heads=3, context_length=32, ffn="gelu_tanh"),
    "minGPT's gpt-nano (3L/3H/48) for toy tasks")
