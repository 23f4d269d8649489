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

from qkv.config import ConfigError
from qkv.models.base import QKVModel, build_stack
from qkv.models.bert import BERT, BERTConfig
from qkv.models.registry import register_family, register_preset
from qkv.nn.disentangled import DisentangledAttention, RelativeEmbeddings
from qkv.nn.norm import build_norm

HEADS = ("none", "mlm", "classify", "tag")


@dataclass
class DeBERTaConfig(BERTConfig):
    vocab_size: int = 128100
    type_vocab_size: int = 0
    pooler_act: str = "gelu"
    position: str = "none"  # positions are relative (below), never added to the input
    norm_eps: float = 1e-7
    # relative positions: exact within relative_buckets // 2, log-bucketed out to max_relative_positions;
    # relative_buckets 0 = no bucketing, a table of 2 * max_relative_positions rows
    relative_buckets: int = 256
    max_relative_positions: int = 512
    c2p: bool = True  # the content-to-position term
    p2c: bool = True  # the position-to-content term
    rel_norm: bool = True  # LayerNorm over the relative table (norm_rel_ebd="layer_norm")
    pooler_dropout: float = 0.0  # on [CLS] before the pooler's dense layer
    cls_dropout: float | None = None  # the sequence classifier's dropout; None = dropout

    def validate(self) -> None:
        super().validate()
        name = type(self).__name__
        if self.head not in HEADS:
            raise ConfigError(f"{name}.head: {self.head!r} is not one of {list(HEADS)}")
        if self.relative_buckets == 1 or self.relative_buckets < 0 or self.max_relative_positions < 1:
            raise ConfigError(f"{name}: relative_buckets must be 0 or >= 2 and max_relative_positions >= 1, "
                              f"got {self.relative_buckets} and {self.max_relative_positions}")
        if self.position != "none" or self.placement != "post" or self.norm != "layernorm":
            raise ConfigError(f"{name}: DeBERTa is position=none (relative), placement=post, norm=layernorm")
        if self.head_dim is not None or self.n_kv_heads not in (None, self.n_heads):
            raise ConfigError(f"{name}: head_dim and n_kv_heads are not DeBERTa options")
        for field_name in ("pooler_dropout", "cls_dropout"):
            value = getattr(self, field_name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ConfigError(f"{name}.{field_name} must be in [0, 1)")

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
