"""Multi-head latent attention (MLA; DeepSeek-V2 section 2.1, DeepSeek-V3).

Keys and values are not cached per head: each token is compressed to one latent vector c (kv_lora_rank wide,
RMS-normed) plus one rotary key k_R (qk_rope_head_dim wide) that every head shares; the heads' keys and values
are linear functions of c.

  queries  q = W_qb RMSNorm(W_qa x)   (or W_q x when q_lora_rank is None)     per head: [q_nope | q_rope]
  latent   [c | k_R] = W_kva x,  c = RMSNorm(c),  k_R = RoPE(k_R)            <- the cache holds (c, k_R)
  keys     k_h = [W_uk,h c | k_R]     values  v_h = W_uv,h c                  (W_kvb = [W_uk; W_uv] per head)
  out      softmax(q_h . k_h * scale) v_h, heads concatenated, W_o

The softmax scale is 1/sqrt(nope + rope) unless the config gives another (DeepSeek's YaRN: times mscale^2).
The cache therefore holds kv_lora_rank + qk_rope_head_dim numbers per token and layer, against
2 * n_kv_heads * head_dim for multi-head / grouped-query attention (DeepSeek-V3: 576 against 32768 for its
128 heads of 128).

Two ways compute the same function, as the DeepSeek papers describe:
  forward()  up-projects the (cached) latent into per-head keys and values and runs ordinary attention: the
             right form for a prefill or training, where the queries are as many as the keys.
  step()     the decoding step, in the absorbed-weights form: W_uk folds into the query (q_nope W_uk is
             kv_lora_rank wide) and W_uv into the output, so a step attends over the cached latent itself as
             one key/value head shared by all heads (multi-query attention of width kv_lora_rank + rope) and
             never up-projects the cache: per token it reads the latent once instead of 2 * heads * head_dim
             numbers.

Caches: LatentCache (below; generate(), beam search, graph-captured steps) and PagedLatentCache
(nn/paged_latent.py; the Engine and `qkv serve`: the same two tensors per token, in shared blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from qkv.nn.attention import BACKENDS, Backend, Unpadded, scaled_dot_product_attention
from qkv.nn.cache import ColumnWrites, KVCache, StaticCache
from qkv.nn.linear import Linear
from qkv.nn.norm import RMSNorm
from qkv.nn.paged_latent import PagedLatentCache

if TYPE_CHECKING:  # pragma: no cover
    from qkv.nn.position import PositionalEncoding


@dataclass
class MLAConfig:
    kv_lora_rank: int = 0  # width of the cached latent c; 0 = not MLA (the model uses MultiHeadAttention)
    q_lora_rank: int | None = None  # queries through a low-rank bottleneck this wide; None = one projection
    qk_nope_head_dim: int = 128  # per-head query/key width without positions (from the latent)
    qk_rope_head_dim: int = 64  # the rotary part: per head for queries, one key shared by all heads
    v_head_dim: int = 128  # per-head value width
    latent_norm_eps: float = 1e-6  # eps of the q / kv latent RMSNorms (DeepSeek fixes it; not rms_norm_eps)
    softmax_scale: float | None = None  # None = 1/sqrt(nope + rope); DeepSeek's YaRN: times mscale^2

    @property
    def enabled(self) -> bool:
        return self.kv_lora_rank > 0

    def cache_width(self) -> int:
        """Numbers cached per token and layer: the latent and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class LatentCache(StaticCache):
    """StaticCache for MLA: per layer the latent c in the keys' place, (B, 1, max_len, kv_lora_rank), and the
    rotary key k_R in the values', (B, 1, max_len, qk_rope_head_dim). Both are laid out as one key/value head,
    so StaticCache's update, write_at (graph-captured steps), reset and reorder (beam search) serve it
    unchanged."""

    def __init__(self, n_layers: int, batch_size: int, kv_lora_rank: int, rope_dim: int, max_len: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__(n_layers, batch_size, 1, kv_lora_rank, max_len, dtype=dtype, device=device,
                         v_head_dim=rope_dim)


def cache_bytes_per_token(cache: StaticCache) -> int:
    """Bytes a StaticCache (or LatentCache) holds per cached position of one sequence, over all layers."""
    batch, max_len = cache.layers[0][0].shape[0], cache.max_len
    return cache.nbytes // (batch * max_len)


class MultiHeadLatentAttention(nn.Module):
    """Causal self-attention with a compressed KV latent; forward() and step() as MultiHeadAttention's.

    Parameter names follow the roles above: q_proj or q_a_proj / q_a_norm / q_b_proj, kv_a_proj (d ->
    kv_lora_rank + rope), kv_a_norm, kv_b_proj (kv_lora_rank -> heads * (nope + v)), out_proj. bias: on
    q_a_proj, kv_a_proj and out_proj (transformers' attention_bias). n_kv_heads is 1: the decoding step's
    scores are laid out as multi-query attention over the latent (Stack.step builds its additive mask from
    it)."""

    def __init__(self, d_model: int, n_heads: int, cfg: MLAConfig, *, causal: bool = True, bias: bool = False,
                 dropout: float = 0.0, backend: Backend = "fused", scaled: bool = True) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
        if not cfg.enabled:
            raise ValueError("multi-head latent attention needs kv_lora_rank > 0")
        self.cfg, self.d_model, self.n_heads, self.n_kv_heads = cfg, d_model, n_heads, 1
        self.cross, self.causal, self.backend, self.dropout = False, causal, backend, dropout
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.head_dim = self.nope + self.rope  # a query's (and key's) width
        self.scale = (cfg.softmax_scale or 1.0 / math.sqrt(self.head_dim)) if scaled else 1.0
        q_out = n_heads * self.head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(d_model, q_out, bias=False)
        else:
            self.q_a_proj = Linear(d_model, cfg.q_lora_rank, bias=bias)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_out, bias=False)
        self.kv_a_proj = Linear(d_model, cfg.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, cfg.latent_norm_eps)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, n_heads * (self.nope + self.v_dim), bias=False)
        self.out_proj = Linear(n_heads * self.v_dim, d_model, bias=bias)

    def _queries(self, x: Tensor) -> Tensor:
        """x (..., d) -> queries (..., heads * (nope + rope))."""
        if self.cfg.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))

    def _latent(self, x: Tensor, B: int, T: int) -> tuple[Tensor, Tensor]:
        """x (B, T, d) or its (B * T, d) rows -> the latent c (B, 1, T, rank), normed, and the unrotated
        shared key k_R (B, 1, T, rope): one "head" each, the cache's layout."""
        c, k_rope = self.kv_a_proj(x).split([self.cfg.kv_lora_rank, self.rope], dim=-1)
        return self.kv_a_norm(c).view(B, 1, T, -1), k_rope.reshape(B, 1, T, self.rope)

    def _split_heads(self, q: Tensor, B: int, T: int) -> tuple[Tensor, Tensor]:
        """(B, T, H * (nope + rope)) or its rows -> q_nope (B, H, T, nope), q_rope (B, H, T, rope)."""
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        return q_nope, q_rope

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
        """MultiHeadAttention.forward's contract (self-attention only): x (B, T, d) -> (B, T, d), the latent
        and rotary key of the new tokens appended to `cache` (a LatentCache), keys and values up-projected
        from every cached latent."""
        if memory is not None:
            raise ValueError("multi-head latent attention is self-attention only (no cross-attention)")
        if unpadded is not None:  # the (B, T) layout throughout: the real rows are gathered back at the end
            y, w = self.forward(unpadded.pad(x), mask=mask, bias=bias, position=position, offset=offset,
                                return_weights=return_weights)
            return unpadded.unpad(y), w
        B, T, _ = x.shape
        q_nope, q_rope = self._split_heads(self._queries(x), B, T)
        c, k_rope = self._latent(x, B, T)
        if position is not None:
            q_rope, k_rope = position.rotate(q_rope, k_rope, offset)
        if cache is not None:
            c, k_rope = _check_cache(cache).update(layer, c, k_rope)
        Tk, H = c.shape[2], self.n_heads
        kv = self.kv_b_proj(c[:, 0]).view(B, Tk, H, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(B, H, Tk, self.rope)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        if last_only and T > 1:  # the newest query sees every key: only masks with a query axis need slicing
            q, T = q[:, :, -1:], 1
            mask = mask[..., -1:, :] if mask is not None and mask.dim() >= 2 and mask.shape[-2] > 1 else mask
            bias = bias[..., -1:, :] if bias is not None and bias.dim() >= 2 and bias.shape[-2] > 1 else bias
        y, w = scaled_dot_product_attention(
            q, k, v, mask=mask, bias=bias, causal=self.causal, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0, backend=self.backend,
            return_weights=return_weights)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, H * self.v_dim)), w

    def absorbed(self) -> tuple[Tensor, Tensor]:
        """kv_b_proj's weight as the per-head W_uk (H, nope, rank) and W_uv (H, v, rank) (views of a plain
        layer's weight; a weight-only quantized kv_b_proj is dequantized per call, and one with unmerged LoRA
        adapters contributes its weight plus their update)."""
        lin = self.kv_b_proj
        w = lin.weight if type(lin) in (Linear, nn.Linear) else None
        if w is None and hasattr(lin, "dequantized"):  # weight-only quantized (nn/quant.py)
            w = lin.dequantized().to(self.kv_a_norm.weight.dtype)
        elif w is None:  # any other layer (LoRA's): its product with the identity is its weight, transposed
            dtype, r = self.kv_a_norm.weight.dtype, self.cfg.kv_lora_rank
            w = lin(torch.eye(r, dtype=dtype, device=self.kv_a_norm.weight.device)).T
        w = w.view(self.n_heads, self.nope + self.v_dim, self.cfg.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope:]

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
        """MultiHeadAttention.step's contract, in the absorbed form (module docstring): x (batch * T, d) rows
        of the new tokens; add (batch, H * T, Tk) the step's additive mask (one key/value head). Returns
        (batch * T, d), or (batch, d) with last_only."""
        B, H, r = batch, self.n_heads, self.cfg.kv_lora_rank
        T = x.shape[0] // B
        q_nope, q_rope = self._split_heads(self._queries(x), B, T)
        c, k_rope = self._latent(x, B, T)
        if position is not None:
            q_rope, k_rope = position.rotate(q_rope, k_rope, offset)
        c, k_rope = _check_cache(cache).update(layer, c, k_rope)  # (B, 1, Tk, r), (B, 1, Tk, rope): views
        if last_only and T > 1:
            q_nope, q_rope, T = q_nope[:, :, -1:], q_rope[:, :, -1:], 1
            add = None if add is None else add.view(B, H, -1, add.shape[-1])[:, :, -1]
        w_uk, w_uv = self.absorbed()
        q_lat = torch.matmul(q_nope, w_uk) * self.scale  # (B, H, T, r): q_nope . (W_uk c) = (q_nope W_uk) . c
        q_rope = q_rope * self.scale
        c0, kr0 = c[:, 0], k_rope[:, 0]  # (B, Tk, r), (B, Tk, rope): the one shared "head"
        q_lat, q_rope = q_lat.reshape(B, H * T, r), q_rope.reshape(B, H * T, self.rope)
        scores = torch.bmm(q_lat, c0.transpose(1, 2)) if add is None \
            else torch.baddbmm(add, q_lat, c0.transpose(1, 2))
        scores = scores.baddbmm_(q_rope, kr0.transpose(1, 2))  # + the rotary part, in place
        o_lat = torch.bmm(torch.softmax(scores, dim=-1), c0).view(B, H, T, r)  # attention-weighted latents
        y = torch.matmul(o_lat, w_uv.transpose(1, 2))  # (B, H, T, v): W_uv applied after the weighting
        return self.out_proj(y.transpose(1, 2).reshape(B * T, H * self.v_dim))


def _check_cache(cache: KVCache) -> KVCache:
    """MLA's cache holds latents: a plain StaticCache or PagedKVCache (per-head K/V) would mix layouts."""
    inner = cache.cache if isinstance(cache, ColumnWrites) else cache
    if not isinstance(inner, (LatentCache, PagedLatentCache)):
        raise TypeError(f"multi-head latent attention caches its latent in a LatentCache "
                        f"(model.make_cache()) or a PagedLatentCache (model.make_paged_cache()), got "
                        f"{type(inner).__name__}")
    return cache
