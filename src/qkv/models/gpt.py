"""GPT: a decoder-only causal language model (Radford et al. 2018/2019).

token ids (B, T) -> token embedding -> [position.embed] -> N causal Pre-LN blocks -> final norm
-> LM head (tied to the token embedding) -> logits (B, T, vocab). Loss: next-token cross-entropy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor, nn

from qkv.config import ConfigError, TransformerConfig, check_fields, memory_bytes, setting
from qkv.models.base import ModelOutput, TransformerDecoderModel, build_stack, token_loss
from qkv.models.decoding import Source
from qkv.models.registry import register_family, register_preset
from qkv.nn.checks import check_batch, check_labels, check_length, check_token_ids
from qkv.nn.linear import Linear
from qkv.nn.mla import LatentCache, MLAConfig
from qkv.nn.moe import SCORES, MoEConfig, moe_aux_loss, update_router_biases
from qkv.nn.paged_latent import PagedLatentCache


def check_moe(moe: Any, n_layers: int | None = None) -> None:
    """A mixture-of-experts config (qkv.nn.moe.MoEConfig): n_layers, the model's, to check `layers`
    against."""
    check_fields(moe, "moe")
    if moe.n_experts < 0:
        raise ConfigError(f"moe.n_experts must be >= 0 (0 = dense), got {moe.n_experts}")
    if not moe.n_experts:
        return
    if not 1 <= moe.n_experts_per_tok <= moe.n_experts:
        raise ConfigError(f"moe.n_experts_per_tok must be in 1..n_experts ({moe.n_experts}), "
                          f"got {moe.n_experts_per_tok}")
    if moe.score not in SCORES:
        raise ConfigError(f"moe.score: {moe.score!r} is not one of {list(SCORES)}")
    if moe.n_group < 1 or moe.n_experts % moe.n_group:
        raise ConfigError(f"moe.n_group ({moe.n_group}) must divide n_experts ({moe.n_experts})")
    if not 1 <= moe.topk_group <= moe.n_group:
        raise ConfigError(f"moe.topk_group must be in 1..n_group ({moe.n_group}), got {moe.topk_group}")
    if moe.n_experts_per_tok > moe.topk_group * (moe.n_experts // moe.n_group):
        raise ConfigError(f"moe.n_experts_per_tok ({moe.n_experts_per_tok}) exceeds the experts of "
                          f"topk_group={moe.topk_group} groups")
    bad = [i for i in moe.layers or () if i < 0 or (n_layers is not None and i >= n_layers)]
    if bad:
        raise ConfigError(f"moe.layers {bad} are not blocks of a {n_layers}-layer model")
    for name in ("ffn_dim", "shared_ffn_dim"):
        if getattr(moe, name) is not None and getattr(moe, name) < 1:
            raise ConfigError(f"moe.{name} must be positive (or null)")
    if moe.n_shared_experts < 0 or moe.first_k_dense < 0:
        raise ConfigError("moe.n_shared_experts and moe.first_k_dense must be >= 0")
    if moe.shared_expert_gate and not (moe.n_shared_experts or moe.shared_ffn_dim):
        raise ConfigError("moe.shared_expert_gate needs a shared expert (n_shared_experts or shared_ffn_dim)")
    if moe.aux_loss_coef < 0 or moe.bias_rate < 0 or moe.routed_scaling <= 0:
        raise ConfigError("moe.aux_loss_coef and moe.bias_rate must be >= 0, moe.routed_scaling > 0")


# Python's own memory per expert module (FeedForward, its Linears and parameters' objects), measured with
# tracemalloc on the meta device: ~11 KB, whatever the width
EXPERT_MODULE_BYTES = 10_000


def check_moe_memory(moe: Any, n_layers: int, d_model: int, d_ff: int) -> None:
    """The routed experts' float32 weights (two matrices each: a lower bound) and module objects, against
    the machine's memory: before a single expert is built, as building 10^9 of them would take days."""
    if not moe.n_experts:
        return
    layers = len(moe.layers) if moe.layers is not None else max(n_layers - moe.first_k_dense, 0)
    need = layers * moe.n_experts * (2 * d_model * (moe.ffn_dim or d_ff) * 4 + EXPERT_MODULE_BYTES)
    have = memory_bytes()
    if have is not None and need > have:
        raise ConfigError(f"moe.n_experts is {moe.n_experts:,}: {layers} layers of them need at least "
                          f"{need / 2**30:,.1f} GiB, more than this machine's {have / 2**30:,.1f} GiB of "
                          "memory")


def check_mla(cfg: Any) -> None:
    """Multi-head latent attention (qkv.nn.mla.MLAConfig in cfg.mla) against the rest of a TransformerConfig:
    its rotary key is RoPE, and the model's head_dim names the rotated width (as transformers'
    DeepseekV3Config)."""
    m = cfg.mla
    check_fields(m, "mla")
    if m.kv_lora_rank < 0:
        raise ConfigError(f"mla.kv_lora_rank must be >= 0 (0 = no MLA), got {m.kv_lora_rank}")
    if not m.kv_lora_rank:
        return
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(m, name) < 1:
            raise ConfigError(f"mla.{name} must be positive, got {getattr(m, name)}")
    if m.q_lora_rank is not None and m.q_lora_rank < 1:
        raise ConfigError("mla.q_lora_rank must be positive (or null: no query compression), got "
                          f"{m.q_lora_rank}")
    # a latent wider than the width it compresses costs more cache and compute than plain attention, and
    # past it the cost is the claim's (10^5: 14 GB of activations for a 128-wide model)
    for name in ("kv_lora_rank", "q_lora_rank"):
        rank = getattr(m, name)
        if rank is not None and rank > cfg.d_model:
            raise ConfigError(f"mla.{name} is {rank}, larger than d_model ({cfg.d_model}): the latent "
                              "compresses the model's width")
    if not (math.isfinite(m.latent_norm_eps) and m.latent_norm_eps >= 0):
        raise ConfigError(f"mla.latent_norm_eps must be a finite number >= 0, got {m.latent_norm_eps}")
    if m.softmax_scale is not None and not (math.isfinite(m.softmax_scale) and m.softmax_scale > 0):
        raise ConfigError(f"mla.softmax_scale must be a finite number > 0 (or null), got {m.softmax_scale}")
    if cfg.position != "rope" or cfg.head_dim != m.qk_rope_head_dim:
        raise ConfigError(f"MLA rotates a shared key of mla.qk_rope_head_dim={m.qk_rope_head_dim}: set "
                          f"position=rope and head_dim={m.qk_rope_head_dim} (got position={cfg.position}, "
                          f"head_dim={cfg.head_dim})")
    if (cfg.n_kv_heads not in (None, cfg.n_heads) or cfg.qk_norm or cfg.qkv_bias
            or cfg.sliding_window is not None):
        raise ConfigError("MLA has its own key/value layout: n_kv_heads, qk_norm, qkv_bias and "
                          "sliding_window must stay unset")


@dataclass
class GPTConfig(TransformerConfig):
    vocab_size: int = setting(65, "token vocabulary", ge=1)
    n_layers: int = setting(4, "decoder blocks", ge=1)
    context_length: int = setting(256, "longest sequence (positions) the model accepts", ge=1)
    tie_embeddings: bool = setting(True, "share the token embedding with the LM head (Press & Wolf 2017)")
    moe: MoEConfig = setting(MoEConfig(), "mixture-of-experts blocks (nn/moe.py); n_experts=0: none")
    mla: MLAConfig = setting(MLAConfig(), "multi-head latent attention (nn/mla.py); kv_lora_rank=0: none")

    def validate(self) -> None:
        super().validate()
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
