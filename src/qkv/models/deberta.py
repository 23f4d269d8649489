"""DeBERTa-v2/v3 encoder (He et al. 2021; He, Gao & Chen 2023): BERT's Post-LN encoder with disentangled
attention, where positions never enter the token vectors but every layer's scores (nn/disentangled.py).

ids (B, T) -> tok (+ type) embeddings -> LayerNorm -> zero the padding -> N Post-LN blocks with
           disentangled attention over a shared, LayerNorm'd table of relative positions -> hidden (B, T, d)
           -> ContextPooler (dropout, dense, GELU on [CLS]) -> classifier | per-token classifier

Everything else (heads, losses, unpadded training, checks) is BERT's: DeBERTa is a BERT subclass that
replaces the embedding step, the pooler and the attention layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from qkv.config import ConfigError, setting
from qkv.models.base import QKVModel, build_stack
from qkv.models.bert import BERT, BERTConfig
from qkv.models.registry import register_family, register_preset
from qkv.nn.disentangled import DisentangledAttention, RelativeEmbeddings
from qkv.nn.norm import build_norm


@dataclass
class DeBERTaConfig(BERTConfig):
    vocab_size: int = BERTConfig.override("vocab_size", 128100)
    type_vocab_size: int = BERTConfig.override("type_vocab_size", 0)
    pooler_act: str = BERTConfig.override("pooler_act", "gelu")
    # positions are relative (below), never added to the input
    position: str = BERTConfig.override("position", "none")
    norm_eps: float = BERTConfig.override("norm_eps", 1e-7)
    # relative positions: exact within relative_buckets // 2, log-bucketed out to max_relative_positions
    relative_buckets: int = setting(256, "log buckets of relative positions (not 1)", ge=0,
                                    note="0 = no bucketing, a table of 2 * max_relative_positions rows")
    max_relative_positions: int = setting(512, "the farthest relative position told apart", ge=1)
    c2p: bool = setting(True, "the content-to-position term")
    p2c: bool = setting(True, "the position-to-content term")
    rel_norm: bool = setting(True, "LayerNorm over the relative table (norm_rel_ebd='layer_norm')")
    pooler_dropout: float = setting(0.0, "on [CLS] before the pooler's dense layer", ge=0, lt=1)
    cls_dropout: float | None = setting(None, "the sequence classifier's dropout", ge=0, lt=1, none="dropout")

    def validate(self) -> None:
        super().validate()
        name = type(self).__name__
        if self.relative_buckets == 1:
            raise ConfigError(f"must be 0 or at least 2, got {self.relative_buckets}", "relative_buckets",
                              name)
        if self.position != "none" or self.placement != "post" or self.norm != "layernorm":
            raise ConfigError(f"{name}: DeBERTa is position=none (relative), placement=post, norm=layernorm")
        if self.head_dim is not None or self.n_kv_heads not in (None, self.n_heads):
            raise ConfigError(f"{name}: head_dim and n_kv_heads are not DeBERTa options")

    @property
    def terms(self) -> tuple[str, ...]:
        return tuple(t for t in ("c2p", "p2c") if getattr(self, t))


class DeBERTa(BERT):
    # the token-wise layers run on the real tokens only in training, as BERT's (DisentangledAttention takes
    # the rows)
    unpad_in_training: bool = True

    def __init__(self, config: DeBERTaConfig) -> None:
        QKVModel.__init__(self, config)
        c = config
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.type_emb = nn.Embedding(c.type_vocab_size, c.d_model) if c.type_vocab_size else None
        # the embedding LayerNorm is the model's, not the stack's: the padding is zeroed after it
        self.embed_norm = build_norm("layernorm", c.d_model, c.norm_eps)
        positions = RelativeEmbeddings(c.d_model, c.relative_buckets, c.max_relative_positions,
                                       norm=c.rel_norm, norm_eps=c.norm_eps)
        self.encoder = build_stack(c, c.n_layers, max_len=c.context_length, causal=False, position=positions)
        for block in self.encoder.blocks:
            block.attn = DisentangledAttention(c.d_model, c.n_heads, terms=c.terms, dropout=c.attn_dropout,
                                               pos_dropout=c.dropout, backend=c.attention)
        self.pool_drop = nn.Dropout(c.pooler_dropout)
        use_cls = c.head == "classify" and c.cls_dropout is not None
        self._add_heads(c.cls_dropout if use_cls else c.dropout)  # BERT's heads (DebertaV2For...'s)

    def _embed(self, input_ids: Tensor, token_type_ids: Tensor | None, keep: Tensor | None) -> Tensor:
        """LayerNorm'd embeddings with the padded positions zeroed: their keys and values then carry the
        projections' biases only, as in the reference (what the padded query rows average over)."""
        x = self.embed_norm(super()._embed(input_ids, token_type_ids, keep))
        return x if keep is None else x * keep.unsqueeze(-1).to(x.dtype)

    def _pool(self, h: Tensor) -> Tensor:
        return super()._pool(self.pool_drop(h[:, :1]))


register_family("deberta", DeBERTaConfig, DeBERTa)
register_preset("deberta-v3-base", "deberta", DeBERTaConfig(),
                "DeBERTa-v3-base shape, 184M with its 128k vocabulary (He, Gao & Chen 2023)")
register_preset("deberta-tiny", "deberta", DeBERTaConfig(
    vocab_size=256, n_layers=2, d_model=64, n_heads=2, context_length=128, relative_buckets=32,
    max_relative_positions=128), "2 layers, 64 wide, relative buckets 32: CPU-sized")
