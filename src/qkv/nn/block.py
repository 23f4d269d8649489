"""One Transformer layer: self-attention, optional cross-attention, feed-forward, each in a residual.

  Pre-LN  (GPT-2, most modern models):  x = x + Sublayer(Norm(x))
  Post-LN (Vaswani 2017, BERT):          x = Norm(x + Sublayer(x))

Post-LN normalises the *sum* of the residual and the sublayer output; it must never drop the residual
(PyTorch #61165). Pre-LN leaves the residual stream un-normalised, so a stack of Pre-LN blocks needs a
final norm (see stack.py); Post-LN needs none.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Literal

from torch import Tensor, nn

from qkv.nn.attention import MultiHeadAttention
from qkv.nn.ffn import FeedForward
from qkv.nn.mla import MLAConfig, MultiHeadLatentAttention
from qkv.nn.moe import MoEConfig, MoEFeedForward
from qkv.nn.norm import build_norm

if TYPE_CHECKING:  # pragma: no cover
    from qkv.nn.attention import Unpadded
    from qkv.nn.cache import KVCache
    from qkv.nn.position import PositionalEncoding

Placement = Literal["pre", "post"]
PLACEMENTS = ("pre", "post")


class Block(nn.Module):
    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        d_ff: int | None = None,
        n_kv_heads: int | None = None,
        ffn: str = "gelu",
        norm: str = "layernorm",
        norm_eps: float = 1e-5,
        placement: Placement = "pre",
        causal: bool = False,
        cross_attention: bool = False,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        bias: bool = True,
        attention: str = "fused",
        scaled: bool = True,
        head_dim: int | None = None,
        qkv_bias: bool | None = None,
        qk_norm: bool = False,
        moe: MoEConfig | None = None,
        mla: MLAConfig | None = None,
    ) -> None:
        super().__init__()
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown norm placement {placement!r}; choose one of {PLACEMENTS}")
        self.placement = placement
        mha = dict(n_kv_heads=n_kv_heads, bias=bias, dropout=attn_dropout, backend=attention, scaled=scaled,
                   head_dim=head_dim, qkv_bias=qkv_bias, qk_norm=qk_norm, qk_norm_eps=norm_eps)
        # multi-head latent attention (mla.py) is the same block with another self-attention module
        self.attn = MultiHeadAttention(d_model, n_heads, causal=causal, **mha) if mla is None else \
            MultiHeadLatentAttention(d_model, n_heads, mla, causal=causal, bias=bias, dropout=attn_dropout,
                                     backend=attention, scaled=scaled)
        self.norm1 = build_norm(norm, d_model, norm_eps, bias)
        self.cross = MultiHeadAttention(d_model, n_heads, cross=True, **mha) if cross_attention else None
        self.norm_cross = build_norm(norm, d_model, norm_eps, bias) if cross_attention else None
        # an MoE block is the same block with a mixture of experts in the feed-forward's place (moe.py)
        self.ffn = FeedForward(d_model, d_ff or 4 * d_model, ffn, bias) if moe is None \
            else MoEFeedForward(d_model, moe, d_ff or 4 * d_model, ffn, bias)
        self.norm2 = build_norm(norm, d_model, norm_eps, bias)
        self.drop = nn.Dropout(dropout)

    def _residual(self, x: Tensor, norm: Callable[..., Tensor], fn: Callable[..., Tensor],
                  keep: Tensor | None, *args: object) -> Tensor:
        """The one place placement is decided. Pre-LN: x + f(norm(x)); Post-LN: norm(x + f(x)), with
        f = fn(., *args). Residual dropout only where it does something (training, p > 0): the decoding
        step calls this too."""
        if self.placement == "pre":
            y = fn(norm(x, keep), *args)
            return x + (self.drop(y) if self.training and self.drop.p > 0 else y)
        y = fn(x, *args)
        return norm(x + (self.drop(y) if self.training and self.drop.p > 0 else y), keep)

    def _last_residual(self, x: Tensor, norm: Callable[..., Tensor], fn: Callable[..., Tensor],
                       keep: Tensor | None) -> Tensor:
        """_residual for a sublayer that reads every position but returns the last one only (self-attention
        with last_only): x[:, -1:] + f(norm(x)) (Pre-LN) or norm(x[:, -1:] + f(x)) (Post-LN), (B, 1, d)."""
        y = fn(norm(x, keep) if self.placement == "pre" else x)
        y = x[:, -1:] + (self.drop(y) if self.training and self.drop.p > 0 else y)
        return y if self.placement == "pre" else norm(y, None if keep is None else keep[:, -1:])

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        bias: Tensor | None = None,
        keep: Tensor | None = None,
        memory: Tensor | None = None,
        memory_mask: Tensor | None = None,
        position: PositionalEncoding | None = None,
        offset: int | Tensor = 0,
        cache: KVCache | None = None,
        layer: int = 0,
        return_weights: bool = False,
        unpadded: Unpadded | None = None,
        last_only: bool = False,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """x: (B, T, d). mask: self-attention keep-mask (B, 1, 1|T, Tk); keep: (B, T) real-token mask
        (for BatchNorm); memory/memory_mask: encoder output and its keep-mask, for cross-attention.
        unpadded: x is (N, d), the real tokens' rows of a padded batch (see attention.Unpadded); only the
        self-attention product goes back to the (B, T) layout. last_only (the top block of a forward that
        needs the last position only): self-attention reads every position (keys, values, the cache), and
        returns, like everything after it, the last position only: x comes back as (B, 1, d). Returns
        (x, {"self": weights, "cross": weights}) with weights only when asked for."""
        weights: dict[str, Tensor] = {}

        def self_attention(h: Tensor) -> Tensor:
            y, w = self.attn(h, mask=mask, bias=bias, position=position, offset=offset,
                             cache=cache, layer=layer,
                             return_weights=return_weights, unpadded=unpadded, last_only=last_only)
            if w is not None:
                weights["self"] = w
            return y

        def cross_attention(h: Tensor) -> Tensor:
            y, w = self.cross(h, memory=memory, mask=memory_mask, cache=cache, layer=layer,
                              return_weights=return_weights)
            if w is not None:
                weights["cross"] = w
            return y

        if last_only:
            x = self._last_residual(x, self.norm1, self_attention, keep)
            keep = None if keep is None else keep[:, -1:]
        else:
            x = self._residual(x, self.norm1, self_attention, keep)
        if self.cross is not None:
            x = self._residual(x, self.norm_cross, cross_attention, keep)
        ffn = self.ffn
        if keep is not None and isinstance(ffn, MoEFeedForward):  # its balancing statistics skip the padding
            ffn = partial(ffn, keep=keep)
        return self._residual(x, self.norm2, ffn, keep), weights

    def step(
        self,
        x: Tensor,
        batch: int,
        cache: KVCache,
        layer: int,
        add: Tensor | None = None,
        cross_add: Tensor | None = None,
        keep: Tensor | None = None,
        position: PositionalEncoding | None = None,
        offset: int | Tensor = 0,
        last_only: bool = False,
    ) -> Tensor:
        """The decoding step (inference): the same function as forward() for the few newest tokens of
        `batch` sequences over a cache, on their (batch * T, d) rows, through the attention's step method
        (MultiHeadAttention.step) and the same norm and feed-forward modules and placement. add / cross_add:
        the additive score terms of the step (attention.step_scores_bias) for self- and cross-attention; keep:
        the (batch * T,) real-token mask of the rows (for the norms). last_only (the top block of a step that
        wants the last token only, without cross-attention): self-attention still caches every new token's
        keys/values, and it and everything after it compute the last token's row only: returns (batch, d)."""
        m = self._modules
        if last_only and x.shape[0] > batch:
            x, keep = self._last_step_residual(x, m["norm1"], keep, batch, cache, layer, add,
                                               position, offset)
        else:
            x = self._residual(x, m["norm1"], m["attn"].step, keep, batch, cache, layer, add,
                               position, offset)
        cross = m.get("cross")  # absent (a plain None) without cross-attention
        if cross is not None:
            x = self._residual(x, m["norm_cross"], cross.step, keep, batch, cache, layer, cross_add)
        return self._residual(x, m["norm2"], m["ffn"], keep)

    def _last_step_residual(self, x: Tensor, norm: Callable[..., Tensor], keep: Tensor | None, batch: int,
                            *args: object) -> tuple[Tensor, Tensor | None]:
        """Block.step's self-attention residual with last_only: the attention reads the (batch * T, d) rows
        and returns the last token's (batch, d); the residual adds it to those rows' x (Pre-LN), or norms the
        sum (Post-LN). Returns the rows and their keep-mask."""
        y = self._modules["attn"].step(norm(x, keep) if self.placement == "pre" else x, batch, *args, True)
        last = x.view(batch, -1, x.shape[-1])[:, -1]
        keep = None if keep is None else keep.view(batch, -1)[:, -1]
        return (last + y if self.placement == "pre" else norm(last + y, keep)), keep

