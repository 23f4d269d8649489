"""Swin Transformer (Liu et al. 2021): attention inside local windows that shift between layers.

pixels (B, C, H, W) -> conv k=p stride=p + LayerNorm -> tokens on a (H/p, W/p) grid, width d
  -> stage 1: depth x SwinLayer (windows of w x w tokens; every second layer shifted by w/2) -> patch merging
  -> stage 2: width 2d, heads x2, grid /2 ... -> LayerNorm -> mean over tokens -> classifier

A SwinLayer is the shared Pre-LN nn.Block run on windows: the (B, H, W, C) grid is cut into (B * nW, w*w, C)
window sequences (windows go into the batch dimension), the Block runs with
  bias = a learned relative position bias B[h, i, j] = table[h, dy(i,j), dx(i,j)] (section 3.2), and
  mask = for shifted layers, which tokens of a rolled window were neighbours before the roll,
and the windows are put back. Norms and the MLP act per token, so running the whole Block on windows is
exactly Swin's block. The shifted layers roll the grid by -w/2 first (cyclic shift, Figure 4) and back after:
their windows straddle the previous layer's window borders, which is how information crosses windows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from qkv.config import ConfigError, TransformerConfig, setting
from qkv.models.base import ModelOutput, QKVModel, class_logits
from qkv.models.registry import register_family, register_preset
from qkv.nn.block import Block
from qkv.nn.norm import build_norm
from qkv.nn.position import PositionalEncoding


def window_partition(x: Tensor, window: int) -> Tensor:
    """(B, H, W, C) -> (B * H/w * W/w, w*w, C): windows in row-major order, batch-major."""
    B, H, W, C = x.shape
    if H % window or W % window:
        raise ValueError(f"grid {H}x{W} is not a multiple of the window size {window}")
    x = x.view(B, H // window, window, W // window, window, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window * window, C)


def window_reverse(windows: Tensor, window: int, H: int, W: int) -> Tensor:
    """Inverse of window_partition: (B * nW, w*w, C) -> (B, H, W, C)."""
    C = windows.shape[-1]
    B = windows.shape[0] // ((H // window) * (W // window))
    x = windows.view(B, H // window, W // window, window, window, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(B, H, W, C)


def shifted_window_mask(H: int, W: int, window: int, shift: int) -> Tensor:
    """(nW, w*w, w*w) bool keep-mask for the cyclically shifted grid: after rolling by -shift, a window at the
    bottom/right edge holds tokens from opposite ends of the image; they must not attend to each other.
    Regions are labelled as in the paper's implementation; tokens may attend iff their labels agree."""
    img = torch.zeros(1, H, W, 1)
    cuts = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    label = 0
    for hs in cuts:
        for ws in cuts:
            img[:, hs, ws, :] = label
            label += 1
    ids = window_partition(img, window).squeeze(-1)  # (nW, N)
    return ids.unsqueeze(1) == ids.unsqueeze(2)


class WindowRelativeBias(PositionalEncoding):
    """Relative position bias for w x w windows: a learned ((2w-1)^2, heads) table indexed by the (dy, dx)
    offset of each query/key pair. Served through the `bias` hook like ALiBi."""

    def __init__(self, window: int, n_heads: int) -> None:
        super().__init__()
        self.window = window
        self.table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, n_heads))
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window),
                                            indexing="ij")).flatten(1)
        rel = coords[:, :, None] - coords[:, None, :] + (window - 1)  # (2, N, N), offsets shifted to >= 0
        self.register_buffer("index", rel[0] * (2 * window - 1) + rel[1], persistent=False)

    def bias(self, q_len: int, k_len: int, causal: bool = False) -> Tensor:
        N = self.window * self.window
        if q_len != N or k_len != N:
            raise ValueError(f"window bias is for {N} tokens, got {q_len} queries and {k_len} keys")
        return self.table[self.index].permute(2, 0, 1).unsqueeze(0)  # (1, heads, N, N)


class SwinLayer(nn.Module):
    """One (shifted-)window attention layer on a fixed (H, W) grid: the shared Block, windowed."""

    def __init__(self, cfg: TransformerConfig, dim: int, n_heads: int, resolution: int, window: int,
                 shift: int, d_ff: int) -> None:
        super().__init__()
        if resolution <= window:  # the window covers the whole grid: nothing to shift (as in Swin)
            window, shift = resolution, 0
        if resolution % window:
            raise ConfigError(f"grid {resolution} is not a multiple of window_size {window}")
        self.resolution, self.window, self.shift = resolution, window, shift
        kw = {**cfg.block_kwargs(), "d_ff": d_ff, "n_kv_heads": None, "placement": "pre"}
        self.block = Block(dim, n_heads, causal=False, **kw)
        self.rel_bias = WindowRelativeBias(window, n_heads)
        if shift:
            self.register_buffer("mask", shifted_window_mask(resolution, resolution, window, shift),
                                 persistent=False)
        else:
            self.mask = None

    def forward(self, x: Tensor, return_weights: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
        """x: (B, H, W, C) -> (B, H, W, C)."""
        B, H, W, C = x.shape
        if (H, W) != (self.resolution, self.resolution):
            raise ValueError(f"this Swin layer was built for a {self.resolution}x{self.resolution} grid, got "
                             f"{H}x{W}")
        if self.shift:
            x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
        win = window_partition(x, self.window)  # (B*nW, N, C)
        mask = None
        if self.mask is not None:  # (nW, N, N) -> (B*nW, 1, N, N), batch-major like the windows
            mask = self.mask.repeat(B, 1, 1).unsqueeze(1)
        N = self.window * self.window
        win, w = self.block(win, mask=mask, bias=self.rel_bias.bias(N, N), return_weights=return_weights)
        x = window_reverse(win, self.window, H, W)
        if self.shift:
            x = torch.roll(x, shifts=(self.shift, self.shift), dims=(1, 2))
        return x, w


class PatchMerging(nn.Module):
    """2x2 neighbouring tokens -> one: concat (4C) -> LayerNorm -> Linear to 2C. Halves the grid."""

    def __init__(self, dim: int, norm: str, eps: float) -> None:
        super().__init__()
        self.norm = build_norm(norm, 4 * dim, eps)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x0, x1 = x[:, 0::2, 0::2], x[:, 1::2, 0::2]
        x2, x3 = x[:, 0::2, 1::2], x[:, 1::2, 1::2]
        return self.reduction(self.norm(torch.cat([x0, x1, x2, x3], dim=-1)))


@dataclass
class SwinConfig(TransformerConfig):
    image_size: int = setting(224, "side of the square input images", ge=1)
    patch_size: int = setting(4, "side of a square patch", ge=1)
    n_channels: int = setting(3, "image channels", ge=1)
    depths: list[int] = setting([2, 2, 6, 2], "layers per stage, each at least 1 (Swin-T)")
    window_size: int = setting(7, "side of the attention windows, in patches", ge=1)
    ffn_ratio: float = setting(4.0, "MLP hidden size = ffn_ratio * stage width")
    head: Literal["classify", "none"] = setting("classify", "classify (logits over num_labels) or none "
                                                "(pooled features only)")
    num_labels: int = setting(1000, "classes of the classification head")
    d_model: int = TransformerConfig.override("d_model", 96)  # stage-1 width; doubles at every patch merging
    n_heads: int = TransformerConfig.override("n_heads", 3)  # stage-1 heads; double with the width
    # Swin has no absolute positions: the relative bias in each window
    position: str = TransformerConfig.override("position", "none")

    def validate(self) -> None:
        super().validate()
        if self.placement != "pre":
            raise ConfigError("SwinConfig.placement must be 'pre'")
        if not self.depths or any(d < 1 for d in self.depths):
            raise ConfigError("SwinConfig.depths must be a non-empty list of positive layer counts")
        if self.image_size % self.patch_size:
            raise ConfigError(f"image_size ({self.image_size}) must be a multiple of patch_size "
                              f"({self.patch_size})")
        grid = self.image_size // self.patch_size
        for i in range(len(self.depths)):
            g = grid >> i
            if g < 1 or (i < len(self.depths) - 1 and g % 2):
                raise ConfigError(f"a {grid}x{grid} token grid cannot be halved {len(self.depths) - 1} times")
            if g > self.window_size and g % self.window_size:
                raise ConfigError(f"stage {i + 1}'s {g}x{g} grid is not a multiple of window_size "
                                  f"{self.window_size}")


class Swin(QKVModel):
    kinds: ClassVar[tuple[str, ...]] = ("image",)

    def __init__(self, config: SwinConfig) -> None:
        super().__init__(config)
        c = config
        self.patch_emb = nn.Conv2d(c.n_channels, c.d_model, kernel_size=c.patch_size, stride=c.patch_size)
        self.patch_norm = build_norm(c.norm, c.d_model, c.norm_eps, c.bias)
        self.stages = nn.ModuleList()
        self.merges = nn.ModuleList()
        grid, dim, heads = c.image_size // c.patch_size, c.d_model, c.n_heads
        for i, depth in enumerate(c.depths):
            # layers alternate regular / shifted windows: ("W-MSA", "SW-MSA") * depth/2
            self.stages.append(nn.ModuleList([
                SwinLayer(c, dim, heads, grid, c.window_size, (c.window_size // 2) if j % 2 else 0,
                          int(c.ffn_ratio * dim)) for j in range(depth)]))
            if i < len(c.depths) - 1:
                self.merges.append(PatchMerging(dim, c.norm, c.norm_eps))
                grid, dim, heads = grid // 2, dim * 2, heads * 2
        self.final_norm = build_norm(c.norm, dim, c.norm_eps, c.bias)
        self.classifier = nn.Linear(dim, c.num_labels) if c.head == "classify" else None
        self.head_drop = nn.Dropout(c.dropout)
        self.init_weights(sum(c.depths))
        for m in self.modules():  # the bias tables start near zero (trunc normal 0.02 in the paper)
            if isinstance(m, WindowRelativeBias):
                nn.init.normal_(m.table, std=0.02)

    def forward(self, pixel_values: Tensor, *, labels: Tensor | None = None,
                return_attentions: bool = False) -> ModelOutput:
        """pixel_values: (B, C, H, W) with H = W = image_size; labels: (B,) class ids."""
        c = self.config
        if pixel_values.dim() != 4 or pixel_values.shape[1:] != (c.n_channels, c.image_size, c.image_size):
            raise ValueError(f"pixel_values must be (B, {c.n_channels}, {c.image_size}, {c.image_size}), "
                             f"got {tuple(pixel_values.shape)}")
        x = self.patch_emb(pixel_values).permute(0, 2, 3, 1)  # (B, H', W', d)
        x = self.patch_norm(x)
        attentions = []
        for i, stage in enumerate(self.stages):
            for layer in stage:
                x, w = layer(x, return_attentions)
                if return_attentions:
                    attentions.append(w)
            if i < len(self.merges):
                x = self.merges[i](x)
        h = self.final_norm(x.flatten(1, 2))  # (B, tokens, dim)
        pooled = h.mean(dim=1)
        logits, loss, n = class_logits(self.classifier, self.head_drop, pooled, labels)
        return ModelOutput(logits=logits, loss=loss, n_targets=n, last_hidden_state=h, pooled=pooled,
                           attentions=attentions or None)


register_family("swin", SwinConfig, Swin)
register_preset("swin-tiny", "swin", SwinConfig(), "Swin-T: 224x224, patch 4, window 7, depths 2-2-6-2, 28M")
register_preset("swin-digits", "swin", SwinConfig(
    image_size=8, patch_size=2, n_channels=1, depths=[2, 2], window_size=2, d_model=48, n_heads=2,
    num_labels=10, dropout=0.1),
                "8x8 grey digits: 2x2 patches, 2x2 windows, 2 stages of 2 layers, 48 -> 96 wide")
