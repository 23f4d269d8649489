"""One Transformer layer: self-attention, optional cross-attention, feed-forward, each in a residual.

  Pre-LN  (GPT-2, most modern models):  x = x + Sublayer(Norm(x))
  Post-LN (Vaswani 2017, BERT):          x = Norm(x + Sublayer(x))

Post-LN normalises the *sum* of the residual and the sublayer output; it must never drop the residual
(PyTorch #61165). Pre-LN leaves the residual stream un-normalised, so a stack of Pre-LN blocks needs a
final norm (see stack.py); Post-LN needs none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from torch import Tensor, nn

from qkv.nn.attention import MultiHeadAttention
from qkv.nn.ffn import FeedForward
from qkv.nn.norm import build_norm

if TYPE_CHECKING:  # pragma: no cover
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
    ) -> None:
        super().__init__()
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown norm placement {placement!r}; choose one of {PLACEMENTS}")
        self.placement = placement
        mha = dict(n_kv_heads=n_kv_heads, bias=bias, dropout=attn_dropout, backend=attention, scaled=scaled)
        self.attn = MultiHeadAttention(d_model, n_heads, causal=causal, **mha)
        self.norm1 = build_norm(norm, d_model, norm_eps, bias)
        self.cross = MultiHeadAttention(d_model, n_heads, cross=True, **mha) if cross_attention else None
        self.norm_cross = build_norm(norm, d_model, norm_eps, bias) if cross_attention else None
        self.ffn = FeedForward(d_model, d_ff or 4 * d_model, ffn, bias)
        self.norm2 = build_norm(norm, d_model, norm_eps, bias)
        self.drop = nn.Dropout(dropout)

    def _sublayer(self, x: Tensor, norm: nn.Module, fn, keep: Tensor | None) -> tuple[Tensor, Tensor | None]:
        if self.placement == "pre":
            y, w = fn(norm(x, keep))
            return x + self.drop(y), w
        y, w = fn(x)
        return norm(x + self.drop(y), keep), w

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
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """x: (B, T, d). mask: self-attention keep-mask (B, 1, 1|T, Tk); keep: (B, T) real-token mask
        (for BatchNorm); memory/memory_mask: encoder output and its keep-mask, for cross-attention.
        Returns (x, {"self": weights, "cross": weights}) with weights only when asked for."""
        weights: dict[str, Tensor] = {}
        x, w = self._sublayer(
            x, self.norm1,
            lambda h: self.attn(h, mask=mask, bias=bias, position=position, offset=offset,
                                cache=cache, layer=layer, return_weights=return_weights),
            keep,
        )
        if w is not None:
            weights["self"] = w
        if self.cross is not None:
            x, w = self._sublayer(
                x, self.norm_cross,
                lambda h: self.cross(h, memory=memory, mask=memory_mask, cache=cache, layer=layer,
                                     return_weights=return_weights),
                keep,
            )
            if w is not None:
                weights["cross"] = w
        x, _ = self._sublayer(x, self.norm2, lambda h: (self.ffn(h), None), keep)
        return x, weights
