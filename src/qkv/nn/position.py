"""Positional encodings behind one interface of three hooks.

Every encoding implements
  embed(x, offset)          add absolute position vectors to the input embeddings (sinusoidal, learned)
  rotate(q, k, offset)      rotate queries and keys by their position (RoPE)
  bias(q_len, k_len)        an additive attention bias (ALiBi, T5's bucketed relative bias)
and is the identity for the hooks that do not apply, so blocks never ask which encoding they hold.
`offset` is the position of the first token of x: an int, or a (B,) LongTensor when the sequences of
a batch start at different positions (left-padded batched generation). Negative positions (padding
before the first real token) are clamped to 0; those positions are masked anyway.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ENCODINGS = ("none", "sinusoidal", "learned", "rope", "alibi", "relative")


def positions(offset: int | Tensor, length: int, device: torch.device) -> Tensor:
    """Absolute positions: (T,) for an int offset, (B, T) for a per-sequence offset."""
    ar = torch.arange(length, device=device)
    if isinstance(offset, Tensor):
        return (offset.to(device).view(-1, 1) + ar).clamp_min(0)
    return (ar + offset).clamp_min(0) if offset < 0 else ar + offset


def last_position(offset: int | Tensor, length: int) -> int | None:
    """offset + length as a Python int (one past the last position used), or None where reading a tensor
    offset would cost a device-to-host sync (accelerators, torch.compile): there the stack has announced
    a bound with `reserve` once per forward instead."""
    if isinstance(offset, Tensor):
        if offset.device.type != "cpu" or torch.compiler.is_compiling():
            return None
        return int(offset.max()) + length
    return offset + length


SINUSOIDAL_LAYOUTS = ("interleaved", "halves")


def sinusoidal_table(n_positions: int, d_model: int, layout: str = "interleaved") -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) (Vaswani 2017, 3.5).
    layout="halves" puts the same sines in the first ceil(d/2) channels and the cosines after them (Marian /
    OPUS-MT, XLM): a permutation of the channels, the same function otherwise."""
    if layout not in SINUSOIDAL_LAYOUTS:
        raise ValueError(f"unknown sinusoidal layout {layout!r}; choose one of {SINUSOIDAL_LAYOUTS}")
    pos = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)
    inv = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.zeros(n_positions, d_model, dtype=torch.float64)
    if layout == "halves":
        half = (d_model + 1) // 2
        table[:, :half] = torch.sin(pos * inv)
        table[:, half:] = torch.cos(pos * inv)[:, : d_model // 2]
        return table.float()
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv)[:, : d_model // 2]
    return table.float()


class PositionalEncoding(nn.Module):
    """Base class: the identity for all three hooks ('none').

    `reserve(n)` is called by the stack once per forward with a Python int: positions below n will be used.
    An absolute table raises a clear error past its length there, RoPE grows its table, so that the hooks
    themselves never read a tensor offset back to the host on an accelerator."""

    max_len: int | None = None  # positions an absolute table covers; None = no hard limit

    def embed(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        return x

    def rotate(self, q: Tensor, k: Tensor, offset: int | Tensor = 0) -> tuple[Tensor, Tensor]:
        return q, k

    def bias(self, q_len: int, k_len: int, causal: bool = True) -> Tensor | None:
        return None

    def reserve(self, n_positions: int) -> None:
        if self.max_len is not None and n_positions > self.max_len:
            raise ValueError(
                f"sequence reaches position {n_positions} but this model's context is {self.max_len} "
                f"positions ({type(self).__name__}); shorten the input"
            )

    def check_length(self, offset: int | Tensor, length: int) -> None:
        """reserve() for offset + length, where that is known without a device sync."""
        last = last_position(offset, length)
        if last is not None:
            self.reserve(last)


class NoPosition(PositionalEncoding):
    pass


class Sinusoidal(PositionalEncoding):
    def __init__(self, d_model: int, max_len: int, layout: str = "interleaved") -> None:
        super().__init__()
        self.max_len = max_len
        self.register_buffer("table", sinusoidal_table(max_len, d_model, layout), persistent=False)

    def embed(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        self.check_length(offset, x.shape[1])
        return x + self.table[positions(offset, x.shape[1], x.device)].to(x.dtype)


class Learned(PositionalEncoding):
    """A trained (skip + max_len, d) table; position p reads row p + skip. skip=2 is BART's layout (its first
    two rows are a fairseq leftover that no position reads)."""

    def __init__(self, d_model: int, max_len: int, skip: int = 0) -> None:
        super().__init__()
        self.max_len, self.skip = max_len, skip
        self.weight = nn.Parameter(torch.zeros(max_len + skip, d_model))

    def embed(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        self.check_length(offset, x.shape[1])
        if isinstance(offset, int) and offset >= 0:
            # contiguous rows: a slice (a view; its backward copies the gradient into a zero table) instead of
            # a gather, whose backward is an accumulating index_put_ (~1% of a CPU training step). Same values
            # and the same gradient bit for bit (each row is read once either way)
            start = offset + self.skip
            return x + self.weight[start: start + x.shape[1]]
        pos = positions(offset, x.shape[1], x.device)
        return x + self.weight[pos + self.skip if self.skip else pos]


ROPE_SCALINGS = ("linear", "llama3", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term 0.1 * mscale * ln(factor) + 1 (1 when the context is not
    extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """What a scaling rule multiplies cos and sin by (so every q.k by its square): YaRN's attention_factor, or
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) (DeepSeek), or mscale(factor); 1 for the
    others."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, m, m_all = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    return yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)


def _yarn(inv: Tensor, head_dim: int, base: float, s: Mapping[str, Any]) -> Tensor:
    """YaRN (Peng et al. 2023): frequencies whose wavelength fits the original context many times (more than
    beta_fast rotations) are kept, those with fewer than beta_slow rotations are divided by factor, and a
    linear ramp over the dimensions between blends the two (transformers' _compute_yarn_parameters)."""
    factor, old = float(s["factor"]), float(s["original_max_position_embeddings"])
    fast, slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension whose wavelength makes `rotations` turns in `old`
        return head_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, dtype=inv.dtype, device=inv.device) - low)
            / (high - low)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def rope_inv_freq(head_dim: int, base: float, scaling: Mapping[str, Any] | None = None,
                  device: torch.device | None = None) -> Tensor:
    """The (head_dim / 2,) float64 rotation frequencies base^(-2i/hd), optionally rescaled for a longer
    context: {"rope_type": "linear", "factor": f} divides every frequency by f (positions / f, Chen et al.
    2023); {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"} divides only the low frequencies (wavelength above
    original / low_freq_factor) by factor, keeps the high ones (below original / high_freq_factor) and blends
    linearly between (Llama 3.1); {"rope_type": "yarn", "factor", "original_max_position_embeddings", optional
    beta_fast, beta_slow, truncate} is YaRN (_yarn; its cos/sin factor: rope_attention_factor)."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return inv
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"unknown RoPE scaling {kind!r}; supported: {ROPE_SCALINGS}")
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "yarn":
        return _yarn(inv, head_dim, base, scaling)
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)


class RoPE(PositionalEncoding):
    """Rotary embeddings (Su et al. 2021), half-split layout: dims (i, i + hd/2) form a rotated pair.

    q_m . k_n depends only on m - n, so no length is baked in; the cos/sin table grows on demand.
    scaling: a context-extension rule for the frequencies (rope_inv_freq; None = the plain formula).
    """

    def __init__(self, head_dim: int, max_len: int = 2048, base: float = 10000.0,
                 scaling: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        self.head_dim, self.base = head_dim, base
        self.scaling = dict(scaling) if scaling else None
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, base, self.scaling).float(),
                             persistent=False)
        self._build(max_len)

    def _build(self, n: int) -> None:
        # from base and head_dim in float64, not from the inv_freq buffer: model.to(bfloat16) rounds that
        # buffer, and a table grown from rounded frequencies is wrong by radians at large positions
        dev = self.inv_freq.device
        inv = rope_inv_freq(self.head_dim, self.base, self.scaling, dev)
        t = torch.arange(n, dtype=torch.float64, device=dev)
        freqs = torch.outer(t, inv)  # (n, hd/2)
        emb = torch.cat([freqs, freqs], dim=-1)
        a = rope_attention_factor(self.scaling)  # YaRN scales the rotated vectors (1 otherwise: exact)
        self.register_buffer("cos", (emb.cos() * a).float(), persistent=False)
        self.register_buffer("sin", (emb.sin() * a).float(), persistent=False)
        # sin with the sign of rotate_half folded in: rotate_half(x) * sin == swap_halves(x) * sin_rot,
        # exactly (a sign flip is exact), one elementwise pass fewer per rotated tensor
        half = freqs.sin() * a
        self.register_buffer("sin_rot", torch.cat([-half, half], dim=-1).float(), persistent=False)

    @staticmethod
    def _swap_halves(x: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x2, x1], dim=-1)

    def reserve(self, n_positions: int) -> None:
        if n_positions > self.cos.shape[0]:
            self._build(max(n_positions, 2 * self.cos.shape[0]))

    def rotate(self, q: Tensor, k: Tensor, offset: int | Tensor = 0) -> tuple[Tensor, Tensor]:
        T = q.shape[-2]
        self.check_length(offset, T)  # grows the table (a no-op when the stack has reserved enough)
        cos, sin = self._tables(offset, T, q)
        return q * cos + self._swap_halves(q) * sin, k * cos + self._swap_halves(k) * sin

    def _tables(self, offset: int | Tensor, T: int, q: Tensor) -> tuple[Tensor, Tensor]:
        """cos and the sign-folded sin of the T positions from offset, broadcastable over (B, n, T, hd) (as in
        rotate)."""
        if isinstance(offset, int) and offset >= 0:
            # one offset for the batch: a view of the tables (no index kernels; this runs in every layer)
            cos, sin = self.cos.narrow(0, offset, T), self.sin_rot.narrow(0, offset, T)  # (T, hd)
        else:
            pos = positions(offset, T, q.device)
            cos, sin = self.cos[pos], self.sin_rot[pos]  # (T, hd) or (B, T, hd)
            if cos.dim() == 3:
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
        if cos.dtype != q.dtype:
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return cos, sin


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


def relative_buckets(relative: Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
    """T5's bucket of each key-minus-query distance (Raffel et al. 2020, mesh-tensorflow's
    _relative_position_bucket): exact buckets for small distances, logarithmic ones up to max_distance, one
    bucket for everything beyond. Bidirectional (encoder): half the buckets for keys after the query.
    Unidirectional (causal decoder): keys after the query share bucket 0 (they are masked anyway)."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).long() * num_buckets
        relative = relative.abs()
    else:
        relative = -torch.clamp(relative, max=0)
    max_exact = num_buckets // 2
    is_small = relative < max_exact
    large = max_exact + (
        torch.log(relative.float() / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, relative, large)


class RelativeBias(PositionalEncoding):
    """T5's relative position bias through the bias hook: a learned scalar per (bucket of key - query
    distance, head), added to the attention scores. The stack computes it once per forward (in its "first
    layer", as T5 does) and every layer adds the same bias. No embeddings, no absolute length limit.
    Buckets are bidirectional for a non-causal stack (encoder) and one-sided for a causal one (decoder),
    taken from the `causal` argument of the hook."""

    def __init__(self, n_heads: int, num_buckets: int = 32, max_distance: int = 128) -> None:
        super().__init__()
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.weight = nn.Parameter(torch.zeros(num_buckets, n_heads))

    def bias(self, q_len: int, k_len: int, causal: bool = True) -> Tensor:
        # queries are the last q_len of k_len positions (bottom-right alignment, as the causal mask)
        dev = self.weight.device
        i = torch.arange(k_len - q_len, k_len, device=dev).view(-1, 1)
        j = torch.arange(k_len, device=dev).view(1, -1)
        b = relative_buckets(j - i, not causal, self.num_buckets, self.max_distance)  # (q_len, k_len)
        return self.weight[b].permute(2, 0, 1).unsqueeze(0)  # (1, H, q_len, k_len)


class FixedTable(PositionalEncoding):
    """Absolute positions read from a given (max_len, d) table, kept as a persistent buffer: saved with the
    weights (a loaded checkpoint brings its own values) but not trained. Whisper's audio encoder uses it for
    its sinusoids, whose layout (all sines, then all cosines) differs from Vaswani's interleaving."""

    def __init__(self, table: Tensor) -> None:
        super().__init__()
        self.max_len = table.shape[0]
        self.register_buffer("weight", table)

    def embed(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        self.check_length(offset, x.shape[1])
        return x + self.weight[positions(offset, x.shape[1], x.device)].to(x.dtype)


def sinusoidal_2d(grid_h: int, grid_w: int, d_model: int) -> Tensor:
    """(grid_h * grid_w, d) table: half the channels encode the row, half the column, each with the 1-D
    sinusoidal formula of Vaswani et al. (the fixed 2-D encoding of MAE, He et al. 2022)."""
    if d_model % 4:
        raise ValueError(f"2-D sinusoidal positions need d_model divisible by 4, got {d_model}")
    rows = sinusoidal_table(grid_h, d_model // 2)  # (gh, d/2)
    cols = sinusoidal_table(grid_w, d_model // 2)  # (gw, d/2)
    table = torch.cat([rows[:, None, :].expand(grid_h, grid_w, -1),
                       cols[None, :, :].expand(grid_h, grid_w, -1)], -1)
    return table.reshape(grid_h * grid_w, d_model)


def interpolate_positions(table: Tensor, old_grid: int, new_grid: tuple[int, int],
                          n_extra: int = 1) -> Tensor:
    """Bicubic resize of a learned (1, n_extra + g*g, d) table to a (gh, gw) grid; extra tokens keep
    theirs."""
    extra, patches = table[:, :n_extra], table[:, n_extra:]
    d = table.shape[-1]
    if patches.shape[1] != old_grid * old_grid:
        raise ValueError(f"position table has {patches.shape[1]} patch positions, expected {old_grid}^2")
    grid = patches.reshape(1, old_grid, old_grid, d).permute(0, 3, 1, 2)  # (1, d, g, g)
    grid = F.interpolate(grid, size=new_grid, mode="bicubic", align_corners=False)
    return torch.cat([extra, grid.permute(0, 2, 3, 1).reshape(1, -1, d)], dim=1)


PATCH_ENCODINGS = ("learned", "sinusoidal2d")


class PatchGrid(PositionalEncoding):
    """Absolute positions of image patches (row-major on a rows x cols grid) after `n_extra` leading tokens
    (ViT's class token), through the embed hook:
      learned       a (1, n_extra + g*g, d) table trained on the native g x g grid, resized by bicubic
                    interpolation for another grid (DeiT/DINO, Hugging Face's interpolate_pos_encoding);
      sinusoidal2d  the 2-D formula, computed for any grid; the extra tokens get a zero vector.
    The front end says which grid its images have with `at_grid((rows, cols))` around the stack call (the
    native grid otherwise); the token count alone cannot tell a 4x6 grid from a 6x4 one. rotate and bias
    come from `inner`, the stack's own 1-D encoding (none by default)."""

    def __init__(self, kind: str, d_model: int, grid: int, n_extra: int = 0,
                 inner: PositionalEncoding | None = None) -> None:
        super().__init__()
        if kind not in PATCH_ENCODINGS:
            raise ValueError(f"unknown patch position encoding {kind!r}; choose one of {PATCH_ENCODINGS}")
        self.kind, self.d_model, self.grid, self.n_extra = kind, d_model, grid, n_extra
        self.inner = inner if inner is not None else NoPosition()
        self.weight = (nn.Parameter(torch.zeros(1, n_extra + grid * grid, d_model)) if kind == "learned"
                       else None)
        self._current: tuple[int, int] | None = None

    @contextmanager
    def at_grid(self, grid: tuple[int, int]) -> Iterator[None]:
        previous, self._current = self._current, (int(grid[0]), int(grid[1]))
        try:
            yield
        finally:
            self._current = previous

    def table(self, grid: tuple[int, int]) -> Tensor:
        """(1, n_extra + rows * cols, d) position vectors for a patch grid."""
        if self.kind == "sinusoidal2d":
            table = sinusoidal_2d(grid[0], grid[1], self.d_model)
            table = torch.cat([table.new_zeros(self.n_extra, self.d_model), table], 0)
            return table.unsqueeze(0)
        if grid == (self.grid, self.grid):
            return self.weight
        return interpolate_positions(self.weight, self.grid, grid, n_extra=self.n_extra)

    def embed(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        grid = self._current or (self.grid, self.grid)
        if x.shape[1] != self.n_extra + grid[0] * grid[1]:
            raise ValueError(f"{x.shape[1]} tokens do not make {self.n_extra} extra token(s) + a "
                             f"{grid[0]}x{grid[1]} patch grid")
        return self.inner.embed(x + self.table(grid).to(device=x.device, dtype=x.dtype), offset)

    def rotate(self, q: Tensor, k: Tensor, offset: int | Tensor = 0) -> tuple[Tensor, Tensor]:
        return self.inner.rotate(q, k, offset)

    def bias(self, q_len: int, k_len: int, causal: bool = True) -> Tensor | None:
        return self.inner.bias(q_len, k_len, causal)

    def reserve(self, n_positions: int) -> None:
        self.inner.reserve(n_positions)


def build_position(kind: str, *, d_model: int, n_heads: int, max_len: int, rope_base: float = 10000.0,
                   rope_scaling: Mapping[str, Any] | None = None, num_buckets: int = 32,
                   max_distance: int = 128, head_dim: int | None = None) -> PositionalEncoding:
    """Factory for the config field `position` (rope_scaling: RoPE's context extension; num_buckets /
    max_distance: the relative bias's; head_dim: RoPE's rotated width when a head is not d_model // n_heads
    wide)."""
    if kind == "none":
        return NoPosition()
    if kind == "sinusoidal":
        return Sinusoidal(d_model, max_len)
    if kind == "learned":
        return Learned(d_model, max_len)
    if kind == "rope":
        return RoPE(head_dim or d_model // n_heads, max_len, rope_base, rope_scaling)
    if kind == "alibi":
        return ALiBi(n_heads)
    if kind == "relative":
        return RelativeBias(n_heads, num_buckets, max_distance)
    raise ValueError(f"unknown position encoding {kind!r}; choose one of {ENCODINGS}")
