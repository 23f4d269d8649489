"""Disentangled attention (He et al. 2021, DeBERTa; v2/v3 as in Hugging Face `deberta-v2`).

Each token is a content vector; positions are not added to it but enter every layer's attention scores as
separate relative terms. With δ(i, j) the bucketed relative position of query i to key j and P the table
of relative-position embeddings (LayerNorm'd), projected by the layer's own query and key weights
(share_att_key: P_q = P W_q + b_q, P_k = P W_k + b_k):

    score(i, j) = ( q_i . k_j                          content-to-content
                  + q_i . P_k[δ(i, j)]                 content-to-position (c2p)
                  + k_j . P_q[-δ(j, i)] ) / sqrt(d * s)  position-to-content (p2c)

s = 1 + the number of position terms in use: each term is scaled like q.k so that their sum keeps its
variance. δ is i - j, kept exact within `buckets // 2` positions and log-bucketed beyond up to
`max_position`, then clipped into the table's 2 * span rows (span = buckets, or max_position unbucketed).

Two modules: `RelativeEmbeddings` is the stack's positional encoding (it adds nothing to the input: the
blocks receive it as `position` and read the table and δ from it), `DisentangledAttention` is a
MultiHeadAttention whose scores carry the two position terms.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn.attention import MultiHeadAttention, Unpadded, scaled_dot_product_attention
from qkv.nn.norm import LayerNorm
from qkv.nn.position import PositionalEncoding

TERMS = ("c2p", "p2c")


def log_buckets(relative: Tensor, buckets: int, max_position: int) -> Tensor:
    """Relative positions (long) -> their buckets: exact for |r| <= buckets // 2 (= mid), beyond that
    mid + ceil(log(|r| / mid) / log((max_position - 1) / mid) * (mid - 1)), with r's sign. The float32 ops
    are those of the reference, so every bucket boundary falls where it falls there."""
    mid = buckets // 2
    sign = torch.sign(relative)
    near = (relative < mid) & (relative > -mid)
    magnitude = torch.where(near, torch.tensor(mid - 1).type_as(relative), relative.abs())
    # evaluated for every entry; the entries within mid (where the log may be of <= 1) keep r below
    log_pos = torch.ceil(torch.log(magnitude / mid) / torch.log(torch.tensor((max_position - 1) / mid))
                         * (mid - 1)) + mid
    return torch.where(magnitude <= mid, relative.type_as(log_pos), log_pos * sign).long()


def relative_positions(q_len: int, k_len: int, buckets: int, max_position: int,
                       device: torch.device | None = None) -> Tensor:
    """(q_len, k_len) long: δ(i, j) = i - j, log-bucketed when buckets > 0."""
    rel = torch.arange(q_len, device=device)[:, None] - torch.arange(k_len, device=device)[None, :]
    return log_buckets(rel, buckets, max_position) if buckets > 0 else rel


class RelativeEmbeddings(PositionalEncoding):
    """The table of 2 * span relative-position embeddings (rows 0..span-1 for δ < 0, span.. for δ >= 0),
    shared by every layer, with an optional LayerNorm over its rows (DeBERTa-v3's norm_rel_ebd)."""

    def __init__(self, d_model: int, buckets: int, max_position: int, *, norm: bool = True,
                 norm_eps: float = 1e-7) -> None:
        super().__init__()
        if buckets == 1 or max_position < 1:
            raise ValueError(f"relative positions need buckets >= 2 (or <= 0: none) and max_position >= 1, "
                             f"got buckets={buckets}, max_position={max_position}")
        self.buckets, self.max_position = buckets, max_position
        self.span = buckets if buckets > 0 else max_position
        self.rel_emb = nn.Embedding(2 * self.span, d_model)
        self.norm = LayerNorm(d_model, norm_eps) if norm else None

    def table(self) -> Tensor:
        """(2 * span, d) the embeddings the layers project (normalised when the model says so)."""
        t = self.rel_emb.weight
        return self.norm(t) if self.norm is not None else t

    def index(self, length: int, device: torch.device) -> Tensor:
        """(length, length) δ(i, j) of a self-attention over `length` positions."""
        return relative_positions(length, length, self.buckets, self.max_position, device)


class DisentangledAttention(MultiHeadAttention):
    """Bidirectional self-attention with DeBERTa's content-to-position and position-to-content terms.

    The q/k/v projections are one fused Linear, as in every qkv layer; the relative embeddings are projected
    through its query and key rows (shared keys). Padding: a padded query row sees no key, and the reference
    fills masked scores with the dtype's lowest finite value instead of -inf, so that row's softmax is uniform
    over all keys; the same fill here makes every position's output equal the reference's in eval mode
    (real tokens never read the padded ones)."""

    def __init__(self, d_model: int, n_heads: int, *, terms: tuple[str, ...] = TERMS, dropout: float = 0.0,
                 pos_dropout: float = 0.0, backend: str = "fused") -> None:
        super().__init__(d_model, n_heads, dropout=dropout, backend=backend)
        bad = [t for t in terms if t not in TERMS]
        if bad:
            raise ValueError(f"unknown disentangled attention term {bad[0]!r}; choose from {TERMS}")
        self.terms = tuple(terms)
        self.scale = 1.0 / math.sqrt(self.head_dim * (1 + len(self.terms)))
        self.pos_drop = nn.Dropout(pos_dropout)

    def forward(self, x: Tensor, *, mask: Tensor | None = None, position: PositionalEncoding | None = None,
                unpadded: Unpadded | None = None, return_weights: bool = False, memory: Tensor | None = None,
                cache: object = None, last_only: bool = False, **_: object) -> tuple[Tensor, Tensor | None]:
        """x: (B, T, d) (or (N, d) real-token rows with `unpadded`); mask: (B, 1, 1, T) bool key mask;
        position: the stack's RelativeEmbeddings. Returns (output like x, weights or None)."""
        if memory is not None or cache is not None or last_only:
            raise ValueError("disentangled attention is bidirectional self-attention over a whole sequence "
                             "(no cross-attention, KV cache or last-position-only forward)")
        if not isinstance(position, RelativeEmbeddings):
            raise ValueError("disentangled attention reads its relative positions from a RelativeEmbeddings "
                             f"encoding, got {type(position).__name__}")
        qkv = self.qkv_proj(x)
        if unpadded is not None:
            qkv = unpadded.pad(qkv)
        B, T, _ = qkv.shape
        q, k, v = (self._heads(t, self.n_heads) for t in qkv.split(self.q_dim, dim=-1))
        bias = self.relative_scores(q, k, position) * self.scale
        if mask is not None:
            both = mask & mask.transpose(-1, -2)  # (B, 1, T, T): query and key both real
            bias = bias.masked_fill(~both, torch.finfo(q.dtype).min)
        y, w = scaled_dot_product_attention(q, k, v, bias=bias, scale=self.scale, backend=self.backend,
                                            dropout_p=self.dropout if self.training else 0.0,
                                            return_weights=return_weights)
        y = y.transpose(1, 2).reshape(B, T, self.q_dim)
        if unpadded is not None:
            y = unpadded.unpad(y)
        return self.out_proj(y), w

    def relative_scores(self, q: Tensor, k: Tensor, position: RelativeEmbeddings) -> Tensor:
        """The c2p + p2c terms, unscaled: (B, H, T, T) (a zero scalar tensor when the model uses neither)."""
        T, span = q.shape[2], position.span
        table = self.pos_drop(position.table()).to(q.dtype)  # (2 span, d)
        w, b = self.qkv_proj.weight, self.qkv_proj.bias
        C = self.q_dim
        delta = position.index(T, q.device)  # δ(i, j)
        out = torch.zeros((), dtype=q.dtype, device=q.device)
        if "c2p" in self.terms:  # q_i . P_k[δ(i, j)]
            # (1, H, 2 span, hd)
            pos_k = self._heads(F.linear(table, w[C:2 * C], b[C:2 * C])[None], self.n_heads)
            c2p = q @ pos_k.transpose(-1, -2)  # (B, H, T, 2 span): every query against every table row
            rows = (delta + span).clamp(0, 2 * span - 1)
            out = out + c2p.gather(-1, rows.expand(*c2p.shape[:2], T, T))
        if "p2c" in self.terms:  # k_j . P_q[-δ(j, i)]: gathered per key row, then transposed to (query, key)
            pos_q = self._heads(F.linear(table, w[:C], b[:C])[None], self.n_heads)
            p2c = k @ pos_q.transpose(-1, -2)  # (B, H, T keys, 2 span)
            rows = (span - delta).clamp(0, 2 * span - 1)
            out = out + p2c.gather(-1, rows.expand(*p2c.shape[:2], T, T)).transpose(-1, -2)
        return out


__all__ = ["DisentangledAttention", "RelativeEmbeddings", "log_buckets", "relative_positions"]
