"""Scaled dot-product attention and multi-head attention.

Attention(Q, K, V) = softmax(Q K^T * scale + bias) V          (Vaswani et al. 2017, eq. 1)

Two backends compute the same function:
  naive  the formula written out; can return the attention probabilities (for maps and ablations).
  fused  torch.nn.functional.scaled_dot_product_attention (flash / memory-efficient kernels on GPU).

Masks follow one convention everywhere in qkv: a boolean tensor where True means "may attend".
The causal mask is aligned bottom-right: with Tq queries and Tk >= Tq keys, query i sees keys
j <= i + (Tk - Tq). That is the only alignment that is correct when the queries are the newest
tokens of a longer cached sequence (KV-cache decoding); SDPA's own is_causal aligns top-left.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn.linear import Linear
from qkv.nn.norm import RMSNorm
from qkv.nn.paged import PoolKeys, PoolRows

if TYPE_CHECKING:  # pragma: no cover
    from qkv.nn.cache import KVCache
    from qkv.nn.position import PositionalEncoding

Backend = Literal["naive", "fused"]
BACKENDS = ("naive", "fused")


def causal_mask(q_len: int, k_len: int, device: torch.device | None = None) -> Tensor:
    """(q_len, k_len) bool, True where query i may see key j (bottom-right aligned)."""
    if k_len < q_len:
        raise ValueError(f"causal attention needs at least as many keys ({k_len}) as queries ({q_len})")
    i = torch.arange(q_len, device=device).unsqueeze(1) + (k_len - q_len)
    j = torch.arange(k_len, device=device).unsqueeze(0)
    return j <= i


def _combined_mask(
    q_len: int, k_len: int, mask: Tensor | None, causal: bool, device: torch.device
) -> Tensor | None:
    """Merge a key-padding / arbitrary mask with the causal mask; None when nothing is masked."""
    if causal and q_len == 1:
        causal = False  # a single newest query sees every cached key
    if not causal:
        return mask
    cm = causal_mask(q_len, k_len, device)
    return cm if mask is None else (mask & cm)


def expand_mask(key_padding_mask: Tensor) -> Tensor:
    """(B, Tk) keep-mask -> (B, 1, 1, Tk), broadcastable over heads and queries."""
    if key_padding_mask.dtype != torch.bool:
        key_padding_mask = key_padding_mask.bool()
    return key_padding_mask[:, None, None, :]


class Unpadded(NamedTuple):
    """Which positions of a right- or left-padded (batch, length) batch hold real tokens, for running the
    token-wise layers (projections, FFN, norms) on the real tokens' rows only ("unpadding", as in
    FlashAttention's varlen path and ModernBERT): with row lengths uniform in [T/2, T] a quarter of those
    matmuls is spent on padding otherwise. Attention alone needs the (B, T) layout: `pad` scatters the rows
    back into it (zeros at the padding, which the key mask hides) and `unpad` gathers them again.
    index: (N,) flat positions b * T + t of the real tokens, in order."""

    index: Tensor
    batch: int
    length: int

    @staticmethod
    def from_keep(keep: Tensor) -> Unpadded:
        """keep: (B, T) bool, True = real token. A host sync (nonzero) on accelerators."""
        B, T = keep.shape
        return Unpadded(keep.reshape(-1).nonzero().squeeze(1), B, T)

    def pad(self, rows: Tensor) -> Tensor:
        """(N, ...) rows -> (B, T, ...), zeros at the padded positions."""
        full = rows.new_zeros((self.batch * self.length, *rows.shape[1:]))
        return full.index_copy(0, self.index, rows).view(self.batch, self.length, *rows.shape[1:])

    def unpad(self, x: Tensor) -> Tensor:
        """(B, T, ...) -> (N, ...), the real tokens' rows."""
        return x.reshape(self.batch * self.length, *x.shape[2:]).index_select(0, self.index)


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: Backend = "naive",
    return_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """q: (B, H, Tq, D); k, v: (B, Hkv, Tk, D) with H a multiple of Hkv (grouped-query attention).

    mask: bool, broadcastable to (B, H, Tq, Tk), True = may attend. bias: float, added to the scores
    (ALiBi, relative position bias). scale: multiplies q.k; default 1/sqrt(D); 1.0 disables scaling.
    Rows with no visible key (a fully padded query) return zeros and zero weights, never NaN.
    Returns (output (B, H, Tq, D), weights (B, H, Tq, Tk) or None).
    """
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({Hkv})")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if backend == "fused" and return_weights:
        backend = "naive"  # fused kernels never materialise the probabilities (PyTorch #98505)
    if backend == "fused" and Tq == 1 and q.device.type == "cpu":
        # One query (a KV-cache decoding step): the same math as two small matmuls. PyTorch's CPU flash kernel
        # costs ~100x more here on the strided views of a preallocated cache (qkv benchmarks/generate.py).
        backend = "naive"
    # GQA/MQA: each group of H // Hkv query heads shares one key/value head. PyTorch's CPU kernel reads the
    # shared head itself (enable_gqa; the same output bit for bit, ~12% faster than attending over copies at
    # 2048 tokens, 9/3 heads: benchmarks/prefill.py); elsewhere the heads are repeated (on CUDA enable_gqa
    # would rule out the memory-efficient kernel).
    gqa = {}
    if Hkv != H:
        if backend == "fused" and q.device.type == "cpu":
            gqa = {"enable_gqa": True}
        else:
            k = k.repeat_interleave(H // Hkv, dim=1)
            v = v.repeat_interleave(H // Hkv, dim=1)

    sdpa = F.scaled_dot_product_attention
    if backend == "fused" and causal and mask is None and bias is None and Tq == Tk:
        # The common training case: let the kernel generate the (square) causal mask itself.
        out = sdpa(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, **gqa)
        return out, None
    full = _combined_mask(Tq, Tk, mask, causal, q.device)

    if backend == "fused":
        attn_mask = full
        if bias is not None:
            attn_mask = bias if full is None else bias.masked_fill(~full, float("-inf"))
            attn_mask = attn_mask.to(q.dtype)
        out = sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, **gqa)
        weights = None
    elif backend == "naive":
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
        if bias is not None:
            scores = scores + bias  # an fp32 bias (ALiBi) promotes bf16 scores: the softmax runs in fp32
        if full is not None:
            scores = scores.masked_fill(~full, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        if mask is not None:
            weights = weights.nan_to_num(0.0)  # a row with every key masked: softmax of all -inf
        w = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
        out = torch.matmul(w.to(v.dtype), v)
    else:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")

    if mask is not None:
        # Zero the rows that see no key at all: the fused kernels return NaN or garbage there. Always applied
        # (one cheap elementwise op) rather than after asking `visible.all()`, a device-to-host sync per
        # layer.
        visible = full.any(dim=-1, keepdim=True)  # (..., Tq, 1)
        out = out.masked_fill(~visible, 0.0)
    return out, (weights if return_weights else None)


def step_scores_bias(
    batch: int, n_heads: int, n_kv_heads: int, q_len: int, k_len: int, *,
    bias: Tensor | None, keep: Tensor | None, causal: bool, dtype: torch.dtype, device: torch.device,
) -> Tensor | None:
    """The one additive term of a decoding step's scores, built once per step for every layer:
    position bias (ALiBi, broadcastable to (B, H, q_len, k_len)) + -inf on masked keys (keep: (B, k_len) bool)
    + the causal mask among q_len > 1 new tokens (causal self-attention). Returned in the grouped layout of
    MultiHeadAttention.step, (B * n_kv_heads, group * q_len, k_len); None when nothing is added."""
    add = None if bias is None else bias.to(dtype)
    visible = None if keep is None else keep.bool()[:, None, None, :]
    if causal and q_len > 1:
        cm = causal_mask(q_len, k_len, device)
        visible = cm if visible is None else visible & cm
    if visible is not None:
        neg = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
        add = neg if add is None else add + neg
    if add is None:
        return None
    group = n_heads // n_kv_heads
    return add.expand(batch, n_heads, q_len, k_len).reshape(batch * n_kv_heads, group * q_len, k_len)


class MultiHeadAttention(nn.Module):
    """Multi-head self- or cross-attention with optional grouped-query heads.

    Self-attention uses one fused Linear for Q, K and V (one matmul instead of three); cross-attention
    projects Q from the decoder and K, V from the encoder memory. n_kv_heads < n_heads gives GQA
    (n_kv_heads == 1: MQA); a KV cache then stores only the n_kv_heads heads.

    Variants of released models, as keywords whose defaults are the plain layer: head_dim (Gemma, Qwen3:
    n_heads * head_dim may differ from d_model), qkv_bias (Qwen2: biases on q/k/v only; None = `bias`),
    qk_norm (Qwen3, OLMo2: an RMSNorm over each head's queries and keys before RoPE, with eps qk_norm_eps).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        cross: bool = False,
        bias: bool = True,
        dropout: float = 0.0,
        backend: Backend = "fused",
        scaled: bool = True,
        causal: bool = False,
        head_dim: int | None = None,
        qkv_bias: bool | None = None,
        qk_norm: bool = False,
        qk_norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if head_dim is None and d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = head_dim or d_model // n_heads
        self.q_dim = n_heads * self.head_dim  # = d_model unless head_dim says otherwise
        self.cross, self.causal, self.backend, self.dropout = cross, causal and not cross, backend, dropout
        # scaled=False is the ablation of the 1/sqrt(d_k) factor (scale 1.0).
        self.scale = 1.0 / math.sqrt(self.head_dim) if scaled else 1.0
        kv_dim = n_kv_heads * self.head_dim
        in_bias = bias if qkv_bias is None else qkv_bias
        if cross:
            self.q_proj = Linear(d_model, self.q_dim, bias=in_bias)
            self.kv_proj = Linear(d_model, 2 * kv_dim, bias=in_bias)
        else:
            self.qkv_proj = Linear(d_model, self.q_dim + 2 * kv_dim, bias=in_bias)
        self.out_proj = Linear(self.q_dim, d_model, bias=bias)
        if qk_norm:  # registered only when used: the plain layer's modules and state dict stay as they were

            self.q_norm, self.k_norm = RMSNorm(self.head_dim,
                                               qk_norm_eps), RMSNorm(self.head_dim, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def _heads(self, x: Tensor, n: int) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, n, self.head_dim).transpose(1, 2)  # (B, n, T, hd)

    def _project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        k, v = self.kv_proj(memory).split(self.n_kv_heads * self.head_dim, dim=-1)
        return self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)

    def forward(
        self,
        x: Tensor,
        *,
        memory: Tensor | None = None,
        mask: Tensor | None = None,
        bias: Tensor | None = None,
        position: PositionalEncoding | None = None,
        offset: int | Tensor = 0,
        cache: KVCache | None = None,
        layer: int = 0,
        return_weights: bool = False,
        unpadded: Unpadded | None = None,
        last_only: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """x: (B, T, d_model). memory: encoder output for cross-attention. mask: bool keep-mask
        broadcastable to (B, H, T, Tk). position.rotate (RoPE) is applied with the given offset.
        With a cache, new K/V are appended and attention runs over all cached keys.
        unpadded (self-attention without a cache): x is (N, d_model), the real tokens' rows of a padded
        (B, T) batch; the projections run on those rows only and the output is (N, d_model) too.
        last_only (self-attention): keys and values of every position (and the cache filled with them), the
        output (B, 1, d_model) of the last query only: the same function for that row, the top layer of a
        forward whose only output is the last position's logits (a prefill before generation)."""
        if unpadded is not None:
            if self.cross or cache is not None:
                raise ValueError("unpadded rows are for self-attention without a KV cache")
            y, w = self._unpadded(x, unpadded, mask, bias, position, offset, return_weights)
            return y, w
        B, T, C = x.shape
        if self.cross:
            if memory is None and (cache is None or not cache.has_cross(layer)):
                raise ValueError("cross-attention needs the encoder memory")
            q = self._heads(self.q_proj(x), self.n_heads)
            if cache is not None:
                if not cache.has_cross(layer):  # encoder K/V are projected once per generation
                    k, v = self._project_kv(memory)
                    cache.set_cross(layer, k.contiguous(), v.contiguous())  # contiguous: step() views them
                k, v = cache.get_cross(layer)
            else:
                k, v = self._project_kv(memory)
        else:
            q, k, v = self._self_qkv(self.qkv_proj(x), position, offset)
            if cache is not None:
                k, v = cache.update(layer, k, v)
            if last_only and T > 1:
                # The newest query sees every key (bottom-right causal alignment): no causal mask is left, and
                # the attention is two thin products instead of a (T x T) one. Masks and biases that have a
                # query axis keep their last row.
                q, T = q[:, :, -1:], 1
                mask = (mask[..., -1:, :] if mask is not None and mask.dim() >= 2 and mask.shape[-2] > 1
                        else mask)
                bias = (bias[..., -1:, :] if bias is not None and bias.dim() >= 2 and bias.shape[-2] > 1
                        else bias)
        y, w = self._attend(q, k, v, mask, bias, return_weights)
        return self.out_proj(y.reshape(B, T, self.q_dim)), w

    def _self_qkv(self, qkv: Tensor, position: PositionalEncoding | None,
                  offset: int | Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The fused projection's output (B, T, q_dim + 2 kv_dim) -> per-head q, k, v (B, n, T, hd), with the
        optional q/k norms and rotary positions applied."""
        kv_dim = self.n_kv_heads * self.head_dim
        q, k, v = qkv.split([self.q_dim, kv_dim, kv_dim], dim=-1)
        q, k, v = self._heads(q, self.n_heads), self._heads(k, self.n_kv_heads), self._heads(v,
                                                                                             self.n_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if position is not None:
            q, k = position.rotate(q, k, offset)
        return q, k, v

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None,
                return_weights: bool) -> tuple[Tensor, Tensor | None]:
        """softmax(q k^T * scale + bias) v with this layer's settings; y comes back as (B, T, H, hd), heads
        ready to be re-assembled into (B, T, H*hd) by a reshape."""
        y, w = scaled_dot_product_attention(
            q, k, v,
            mask=mask, bias=bias, causal=self.causal, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            backend=self.backend, return_weights=return_weights,
        )
        return y.transpose(1, 2), w

    def _unpadded(self, x: Tensor, u: Unpadded, mask: Tensor | None, bias: Tensor | None,
                  position: PositionalEncoding | None, offset: int | Tensor,
                  return_weights: bool) -> tuple[Tensor, Tensor | None]:
        """forward() on the real tokens' rows x (N, d): the fused QKV projection on N rows, scattered into
        the padded (B, T) layout for the attention product, gathered back before the output projection."""
        q, k, v = self._self_qkv(u.pad(self.qkv_proj(x)), position, offset)
        y, w = self._attend(q, k, v, mask, bias, return_weights)
        return self.out_proj(u.unpad(y.reshape(u.batch, u.length, self.q_dim))), w

    def step(
        self,
        x: Tensor,
        batch: int,
        cache: KVCache,
        layer: int,
        add: Tensor | None = None,
        position: PositionalEncoding | None = None,
        offset: int | Tensor = 0,
        last_only: bool = False,
    ) -> Tensor:
        """The decoding step: the same function as forward() for the T newest tokens of `batch` sequences
        over a cache, for inference. x: (batch * T, d_model), the new tokens' rows (row b * T + t), so every
        projection is one matrix product without reshapes. Self-attention appends its new K/V to the cache
        (any KVCache: static or paged); cross-attention reads the encoder's K/V from the cache (they are
        put there by the first, prefilling forward). add: step_scores_bias(...), the position bias, key
        padding and causal mask of this step in one additive term (None: nothing to add).

        Differences from forward() are in how, not what: the new tokens are rows rather than (B, T) sequences,
        and grouped-query attention folds the query heads of one key/value head into rows of one batched
        matmul instead of repeating the cached keys. Every new token must be a real token (its own key
        visible). last_only (self-attention, the top block of a step whose caller wants the last token only):
        all T tokens' keys/values go into the cache, but only the last token queries them: returns (batch,
        d_model), that token's rows."""
        B, C = batch, self.q_dim
        T = x.shape[0] // B
        H, Hkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        if self.cross:
            if not cache.has_cross(layer):
                raise ValueError("the decoding step reads the encoder's keys/values from the cache: prefill "
                                 "first")
            q = self._scaled(self.q_proj(x))
            k, v = cache.get_cross(layer)
            if k.shape[0] != B:
                return self._shared_cross_step(q, k, v, B, T, add)
            q = q if T == 1 else q.view(B, T, H, hd).transpose(1, 2)  # one token: (B, C) is (B, H, 1, hd)
        else:
            q, k, v = self._step_heads(self.qkv_proj(x), B, T, position, offset)
            q = self._scaled(q)
            # (B, Hkv, Tk, hd): cached + new; the paged cache's keys/values may stay in its pool
            # (PoolKeys/Rows)
            k, v = getattr(cache, "step_update", cache.update)(layer, k, v)
            if last_only and T > 1:  # the other queries' outputs would only feed rows nobody reads
                q, T = q[:, :, -1:], 1
                add = None if add is None else add.view(B * Hkv, H // Hkv, -1, add.shape[-1])[:, :, -1]
        # query head h = j * G + g uses key/value head j (as repeat_interleave in the forward pass)
        q = q.reshape(B * Hkv, (H // Hkv) * T, hd)
        if isinstance(k, PoolKeys):  # the paged cache's keys stay in its pool: q @ K^T read from there
            scores = k.scores(q) if add is None else k.scores(q).add_(add)
            Tk = k.bags.pos.shape[1]
        else:
            Tk = k.shape[2]
            kt = k.reshape(B * Hkv, Tk, hd).transpose(1, 2)
            scores = torch.bmm(q, kt) if add is None else torch.baddbmm(add, q, kt)  # bias and mask in one op
        probs = torch.softmax(scores, dim=-1)
        if isinstance(v, PoolRows):
            y = v.weighted_sum(probs)
        else:
            y = torch.bmm(probs, v.reshape(B * Hkv, Tk, hd))  # (B * Hkv, G * T, hd)
        y = y.view(B, C) if T == 1 else y.view(B, H, T, hd).transpose(1, 2).reshape(B * T, C)
        return self.out_proj(y)

    def _scaled(self, q: Tensor) -> Tensor:
        """q times 1/sqrt(d_k) (RoPE is linear in q, so before or after the rotation is the same function)."""
        return q if self.scale == 1.0 else q * self.scale

    def _step_heads(self, qkv: Tensor, B: int, T: int, position: PositionalEncoding | None,
                    offset: int | Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The step's fused projection output (B * T, C + 2 kv_dim) -> q, k, v heads, with the q/k norms and
        positions applied (the general path of step)."""
        H, Hkv, hd, C = self.n_heads, self.n_kv_heads, self.head_dim, self.q_dim
        kv_dim = Hkv * hd
        q, k, v = qkv.split_with_sizes([C, kv_dim, kv_dim], dim=-1)
        if T == 1:  # (B, n * hd) -> (B, n, 1, hd): a view, no transpose (q is reshaped below as it is)
            k, v = k.view(B, Hkv, 1, hd), v.view(B, Hkv, 1, hd)
        else:
            q, k, v = (t.view(B, T, n, hd).transpose(1, 2) for t, n in ((q, H), (k, Hkv), (v, Hkv)))
        if T == 1:
            q = q.view(B, H, 1, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if position is not None:
            q, k = position.rotate(q, k, offset)
        return q, k, v

    def _shared_cross_step(self, q: Tensor, k: Tensor, v: Tensor, B: int, T: int,
                           add: Tensor | None) -> Tensor:
        """Cross-attention of the decoding step when the encoder K/V (B0, Hkv, S, hd) hold one row per source
        and the B = B0 * R query rows come in groups of R consecutive rows per source (beam search keeps the
        K/V of the first step's B0 rows instead of repeating them for every beam): the R rows' query heads of
        one key/value head become rows of one batched matmul, as the heads of a GQA group do. q: (B * T, C)
        projected and scaled; add: (B0 * Hkv, R * G * T, S) or None. The same function as repeating k and v
        R times (up to fp32 summation order); only the grouping of the products differs."""
        B0, Hkv, S, hd = k.shape
        R, G = B // B0, self.n_heads // Hkv
        # (b0, r, t, j, g) -> (b0, j, r, g, t): the queries of key/value head j of source b0 are one block of
        # rows
        q = q.view(B0, R, T, Hkv, G, hd).permute(0, 3, 1, 4, 2, 5).reshape(B0 * Hkv, R * G * T, hd)
        kt = k.reshape(B0 * Hkv, S, hd).transpose(1, 2)
        scores = torch.bmm(q, kt) if add is None else torch.baddbmm(add, q, kt)
        y = torch.bmm(torch.softmax(scores, dim=-1), v.reshape(B0 * Hkv, S, hd))  # (B0 * Hkv, R * G * T, hd)
        y = y.view(B0, Hkv, R, G, T, hd).permute(0, 2, 4, 1, 3, 5).reshape(B * T, self.q_dim)
        return self.out_proj(y)
