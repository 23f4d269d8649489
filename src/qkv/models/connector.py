"""Idefics3 / SmolVLM's connector: a pixel shuffle, then one Linear without bias.

The vision tower gives a square grid of patch features (n, h * w, d_v). The pixel shuffle folds every
s x s block of neighbouring patches into one vector of s * s * d_v features, so an image costs s**2 times
fewer tokens in the decoder's prompt (SmolVLM-256M: 1024 patches of a 512 px tile -> 64 tokens at s = 4); the
Linear maps that vector to the decoder's width.

The reshapes are transformers' Idefics3Connector.pixel_shuffle, step for step: the order of the s * s * d_v
features inside a token is part of the trained weights, so it must be the same order, not merely a fold.
"""

from __future__ import annotations

from torch import Tensor, nn


def pixel_shuffle(x: Tensor, scale: int) -> Tensor:
    """(n, h * w, d) on a square grid -> (n, h * w / s**2, d * s**2)."""
    n, seq, d = x.shape
    side = int(seq ** 0.5)
    if side * side != seq or side % scale:
        raise ValueError(f"pixel shuffle needs a square grid whose side divides by {scale}, "
                         f"got {seq} patches")
    x = x.reshape(n, side, side // scale, d * scale)  # s neighbours along a row side by side
    x = x.permute(0, 2, 1, 3).reshape(n, side // scale, side // scale, d * scale * scale)  # and s rows
    return x.permute(0, 2, 1, 3).reshape(n, seq // scale ** 2, d * scale ** 2)


class PixelShuffleProjector(nn.Module):
    """Vision features (n, N, d_v) -> (n, N / s**2, d): Idefics3's `connector.modality_projection`."""

    def __init__(self, d_in: int, d_out: int, scale_factor: int) -> None:
        super().__init__()
        self.scale_factor = scale_factor
        self.proj = nn.Linear(d_in * scale_factor ** 2, d_out, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(pixel_shuffle(x, self.scale_factor))
