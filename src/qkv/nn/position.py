"""Positional encodings behind one interface of three hooks.

Every encoding implements
  embed(x, offset)          add absolute position vectors to the input embeddings (sinusoidal, learned)
  rotate(q, k, offset)      rotate queries and keys by their position (RoPE)
  bias(q_len, k_len)        an additive attention bias (ALiBi)
and is the identity for the hooks that do not apply, so blocks never ask which encoding they hold.
`offset` is the position of the first token of x: an int, or a (B,) LongTensor when the sequences of
a batch start at different positions (left-padded batched generation). Negative positions (padding
before the first real token) are clamped to 0; those positions are masked anyway.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

ENCODINGS = ("none", "sinusoidal", "learned", "rope", "alibi")


def positions(offset: int | Tensor, length: int, device: torch.device) -> Tensor:
    """Absolute positions: (T,) for an int offset, (B, T) for a per-sequence offset."""
    ar = torch.arange(length, device=device)
    if isinstance(offset, Tensor):
        return (offset.to(device).view(-1, 1) + ar).clamp_min(0)
    return ar + offset


def _max_position(offset: int | Tensor, length: int) -> int:
    top = int(offset.max()) if isinstance(offset, Tensor) else offset
    return top + length


def sinusoidal_table(n_positions: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) (Vaswani 2017, 3.5)."""
    pos = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)
    inv = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.zeros(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv)[:, : d_model // 2]
    return table.float()


class PositionalEncoding(nn.Module):
    """Base class: the identity for all three hooks ('none')."""

    max_len: int | None = None

    def embed(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        return x

    def rotate(self, q: Tensor, k: Tensor, offset: int | Tensor = 0) -> tuple[Tensor, Tensor]:
        return q, k

    def bias(self, q_len: int, k_len: int, causal: bool = True) -> Tensor | None:
        return None

    def check_length(self, offset: int | Tensor, length: int) -> None:
        if self.max_len is not None and _max_position(offset, length) > self.max_len:
            raise ValueError(
                f"sequence reaches position {_max_position(offset, length)} but this model's context is "
                f"{self.max_len} positions ({type(self).__name__}); shorten the input"
            )


class NoPosition(PositionalEncoding):
    pass


class Sinusoidal(PositionalEncoding):
    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.register_buffer("table", sinusoidal_table(max_len, d_model), persistent=False)

    def embed(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        self.check_length(offset, x.shape[1])
        return x + self.table[positions(offset, x.shape[1], x.device)].to(x.dtype)


class Learned(PositionalEncoding):
    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.weight = nn.Parameter(torch.zeros(max_len, d_model))

    def embed(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        self.check_length(offset, x.shape[1])
        return x + self.weight[positions(offset, x.shape[1], x.device)]


class RoPE(PositionalEncoding):
    """Rotary embeddings (Su et al. 2021), half-split layout: dims (i, i + hd/2) form a rotated pair.

    q_m . k_n depends only on m - n, so no length is baked in; the cos/sin table grows on demand.
    """

    def __init__(self, head_dim: int, max_len: int = 2048, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        self.head_dim, self.base = head_dim, base
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        self._build(max_len)

    def _build(self, n: int) -> None:
        # from base and head_dim in float64, not from the inv_freq buffer: model.to(bfloat16) rounds that
        # buffer, and a table grown from rounded frequencies is wrong by radians at large positions
        dev = self.inv_freq.device
        inv = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=dev) / self.head_dim))
        t = torch.arange(n, dtype=torch.float64, device=dev)
        freqs = torch.outer(t, inv)  # (n, hd/2)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    @staticmethod
    def _rotate_half(x: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    def rotate(self, q: Tensor, k: Tensor, offset: int | Tensor = 0) -> tuple[Tensor, Tensor]:
        T = q.shape[-2]
        need = _max_position(offset, T)
        if need > self.cos.shape[0]:
            self._build(max(need, 2 * self.cos.shape[0]))
        pos = positions(offset, T, q.device)
        cos, sin = self.cos[pos].to(q.dtype), self.sin[pos].to(q.dtype)  # (T, hd) or (B, T, hd)
        if cos.dim() == 3:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        return q, k


def alibi_slopes(n_heads: int) -> Tensor:
    """Head slopes of ALiBi (Press et al. 2022): the geometric sequence 2^(-8/n), 2^(-16/n), ...
    for n a power of two; otherwise those of the closest power of two below, then every other slope
    of the next power of two (the paper's reference implementation)."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        s = power_of_two(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        s = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(s)


class ALiBi(PositionalEncoding):
    """A linear distance penalty -slope_h * |i - j| added to the attention scores; no embeddings."""

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def bias(self, q_len: int, k_len: int, causal: bool = True) -> Tensor:
        # queries are the last q_len of k_len positions (bottom-right alignment, as the causal mask)
        i = torch.arange(k_len - q_len, k_len, device=self.slopes.device).view(-1, 1)
        j = torch.arange(k_len, device=self.slopes.device).view(1, -1)
        dist = (i - j).abs().float()
        return -self.slopes.view(1, -1, 1, 1) * dist  # (1, H, q_len, k_len)


def build_position(kind: str, *, d_model: int, n_heads: int, max_len: int, rope_base: float = 10000.0) -> PositionalEncoding:
    """Factory for the config field `position`."""
    if kind == "none":
        return NoPosition()
    if kind == "sinusoidal":
        return Sinusoidal(d_model, max_len)
    if kind == "learned":
        return Learned(d_model, max_len)
    if kind == "rope":
        return RoPE(d_model // n_heads, max_len, rope_base)
    if kind == "alibi":
        return ALiBi(n_heads)
    raise ValueError(f"unknown position encoding {kind!r}; choose one of {ENCODINGS}")
