"""Vision Transformer (Dosovitskiy et al. 2021): an image is a sequence of patches.

pixels (B, C, H, W) -> conv k=p, stride=p -> patches (B, N, d), N = (H/p)(W/p)
  -> [class token] + positions (learned | 2-D sinusoidal | none) -> N Pre-LN encoder blocks -> final norm
  -> pooled (class token, mean over patches, or attention pooling) -> [tanh pooler] -> classifier
  -> logits (B, num_labels)

The blocks are the shared nn.Block/Stack; only the front end (patches + positions) and the head are new.
A model trained at one image size runs at another: learned position tables are resized by bicubic
interpolation over the patch grid (as in DeiT/DINO and Hugging Face's `interpolate_pos_encoding`), the
2-D sinusoidal table is recomputed for the new grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.config import ConfigError, TransformerConfig, setting
from qkv.models.base import ModelOutput, QKVModel, build_stack, class_logits
from qkv.models.registry import register_family, register_preset
from qkv.nn.ffn import FeedForward
from qkv.nn.position import PatchGrid, build_position, interpolate_positions, sinusoidal_2d

__all__ = ["ViT", "ViTConfig", "interpolate_positions", "patch_attention", "save_attention_overlay",
           "sinusoidal_2d"]


@dataclass
class ViTConfig(TransformerConfig):
    image_size: int = setting(224, "side of the square input images", ge=1)
    patch_size: int = setting(16, "side of a square patch = stride of the patch convolution", ge=1)
    n_channels: int = setting(3, "image channels", ge=1)
    n_layers: int = setting(12, "encoder blocks", ge=1)
    # map: a learned query attends over the patch outputs, then a residual FFN (big_vision's MAPHead, SigLIP)
    pooling: Literal["cls", "mean", "map"] = setting(
        "cls", "cls (a learned class token), mean (of the patch outputs) or map (attention pooling)")
    patch_position: Literal["learned", "sinusoidal2d", "none"] = setting(
        "learned", "positions added to the patches: learned, sinusoidal2d or none")
    head: Literal["classify", "none"] = setting(
        "classify", "classify (logits over num_labels) or none (features only, e.g. CLIP's image tower)")
    num_labels: int = setting(1000, "classes of the classification head")
    pooler: bool = setting(False, "tanh(W pooled + b) as in Hugging Face ViTModel; off in the paper's "
                           "fine-tuning")
    embed_norm: bool = setting(False, "a norm on the embeddings before the first block (CLIP's pre_layrnorm)")
    patch_bias: bool = setting(True, "a bias in the patch convolution (CLIP's has none)")
    # the stack's own encoding; patches get theirs from patch_position
    position: str = TransformerConfig.override("position", "none")
    d_model: int = TransformerConfig.override("d_model", 768)
    n_heads: int = TransformerConfig.override("n_heads", 12)
    d_ff: int | None = TransformerConfig.override("d_ff", 3072)
    norm_eps: float = TransformerConfig.override("norm_eps", 1e-6)

    def validate(self) -> None:
        super().validate()
        if self.image_size % self.patch_size:
            raise ConfigError(f"image_size ({self.image_size}) must be a multiple of patch_size "
                              f"({self.patch_size})")
        if self.patch_position == "sinusoidal2d" and self.d_model % 4:
            raise ConfigError("patch_position=sinusoidal2d needs d_model divisible by 4")

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size


class PatchEmbedding(nn.Module):
    """(B, C, H, W) -> (B, (H/p)(W/p), d): one linear map per non-overlapping p x p patch (a strided conv)."""

    def __init__(self, n_channels: int, d_model: int, patch_size: int, bias: bool = True) -> None:
        super().__init__()
        self.patch_size, self.n_channels = patch_size, n_channels
        self.proj = nn.Conv2d(n_channels, d_model, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, pixels: Tensor) -> tuple[Tensor, tuple[int, int]]:
        if pixels.dim() != 4 or pixels.shape[1] != self.n_channels:
            raise ValueError(f"pixel_values must be (B, {self.n_channels}, H, W), got {tuple(pixels.shape)}")
        H, W = pixels.shape[-2:]
        p = self.patch_size
        if H % p or W % p:
            raise ValueError(f"image size {H}x{W} is not a multiple of the patch size {p}")
        x = self.proj(pixels)  # (B, d, H/p, W/p)
        return x.flatten(2).transpose(1, 2), (H // p, W // p)  # (B, N, d), row-major patches


class AttentionPool(nn.Module):
    """(B, N, d) -> (B, d): one learned probe attends over the N outputs (torch's MultiheadAttention: the
    probe is the query, the outputs keys and values), then x + FFN(LayerNorm(x)) (SigLIP's pooling head)."""

    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.probe = nn.Parameter(torch.randn(1, 1, c.d_model) * c.init_std)
        self.attention = nn.MultiheadAttention(c.d_model, c.n_heads, batch_first=True)
        self.norm = nn.LayerNorm(c.d_model, eps=c.norm_eps)
        self.ffn = FeedForward(c.d_model, c.d_ff or 4 * c.d_model, c.ffn)

    def forward(self, hidden: Tensor) -> Tensor:
        probe = self.probe.expand(hidden.shape[0], -1, -1).to(hidden.dtype)
        x = self.attention(probe, hidden, hidden, need_weights=False)[0]  # (B, 1, d)
        return (x + self.ffn(self.norm(x)))[:, 0]


class ViT(QKVModel):
    kinds: ClassVar[tuple[str, ...]] = ("image",)
    renamed_keys: ClassVar[dict[str, str]] = {"pos_emb": "encoder.position.weight"}  # before the table moved

    def __init__(self, config: ViTConfig) -> None:
        super().__init__(config)
        c = config
        self.patch_emb = PatchEmbedding(c.n_channels, c.d_model, c.patch_size, c.patch_bias)
        n_extra = 1 if c.pooling == "cls" else 0
        self.cls_emb = nn.Parameter(torch.zeros(1, 1, c.d_model)) if n_extra else None
        # patch positions behind the stack's embed hook (nn.position.PatchGrid); config.position (none by
        # default) supplies rotate / bias on top of them
        position = build_position(c.position, d_model=c.d_model, n_heads=c.n_heads,
                                  max_len=n_extra + c.grid**2, rope_base=c.rope_base)
        if c.patch_position != "none":
            position = PatchGrid(c.patch_position, c.d_model, c.grid, n_extra, inner=position)
        self.encoder = build_stack(c, c.n_layers, max_len=n_extra + c.grid**2, causal=False,
                                   position=position, embed_norm=c.embed_norm)
        self.pooler = nn.Linear(c.d_model, c.d_model) if c.pooler else None
        self.map_head = AttentionPool(c) if c.pooling == "map" else None
        self.classifier = nn.Linear(c.d_model, c.num_labels) if c.head == "classify" else None
        self.head_drop = nn.Dropout(c.dropout)
        self.init_weights(c.n_layers)

    # -- forward -----------------------------------------------------------------------------------------
    def features(self, pixel_values: Tensor, return_attentions: bool = False):
        """Encoder outputs (B, n_extra + N, d) and the stack output (for attention weights)."""
        x, grid = self.patch_emb(pixel_values)  # (B, N, d)
        if self.cls_emb is not None:
            x = torch.cat([self.cls_emb.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        position = self.encoder.position
        if isinstance(position, PatchGrid):
            # the grid of these images (the token count cannot tell 4x6 from 6x4)
            with position.at_grid(grid):
                out = self.encoder(x, return_weights=return_attentions)
        else:
            out = self.encoder(x, return_weights=return_attentions)
        return out.hidden, out

    def pool(self, hidden: Tensor) -> Tensor:
        if self.map_head is not None:
            pooled = self.map_head(hidden)
        else:
            pooled = hidden[:, 0] if self.config.pooling == "cls" else hidden.mean(dim=1)
        return torch.tanh(self.pooler(pooled)) if self.pooler is not None else pooled

    def forward(self, pixel_values: Tensor, *, labels: Tensor | None = None,
                return_attentions: bool = False) -> ModelOutput:
        """pixel_values: (B, C, H, W) floats; labels: (B,) class ids. Returns logits (B, num_labels)."""
        h, out = self.features(pixel_values, return_attentions)
        pooled = self.pool(h)
        logits, loss, n = class_logits(self.classifier, self.head_drop, pooled, labels)
        return ModelOutput(logits=logits, loss=loss, n_targets=n, last_hidden_state=h, pooled=pooled,
                           attentions=out.attentions or None)


@torch.no_grad()
def patch_attention(model: ViT, pixel_values: Tensor, layer: int = -1) -> Tensor:
    """(B, gh, gw) attention over the patches in one layer, averaged over heads: from the class token with
    cls pooling, averaged over all queries with mean pooling. Rows sum to 1 over the patches (plus the class
    token's own share, which is left out)."""
    was = model.training
    model.eval()
    out = model(pixel_values, return_attentions=True)
    model.train(was)
    w = out.attentions[layer]["self"].mean(1)  # (B, T, T)
    n_extra = 1 if model.cls_emb is not None else 0
    w = w[:, 0, n_extra:] if n_extra else w.mean(1)
    p = model.config.patch_size
    return w.reshape(w.shape[0], pixel_values.shape[-2] // p, pixel_values.shape[-1] // p)


def save_attention_overlay(model: ViT, pixel_values: Tensor, path: str, layer: int = -1,
                           titles: list[str] | None = None) -> None:
    """A PNG with each image and its patch attention (patch_attention) drawn over it, upsampled to pixels."""
    maps = patch_attention(model, pixel_values, layer)
    images = [pixel_values[b].float().mean(0).cpu() for b in range(pixel_values.shape[0])]
    draw_patch_overlays(images, list(maps), path, titles,
                        f"ViT attention over patches (layer {layer}, mean over heads)")


def draw_patch_overlays(images: list[Tensor], maps: list[Tensor], path: str, titles: list[str] | None = None,
                        title: str = "", panel: float = 2.2) -> None:
    """One PNG, the images in a row: each image ((H, W) grey, or (H, W, 3) RGB in [0, 1]) with its (gh, gw)
    patch map drawn over it as a heat map, each patch upsampled to its pixels; panel: inches per image."""
    import matplotlib  # noqa: PLC0415  (matplotlib: slow to import, only for plots)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    B = len(images)
    fig, axes = plt.subplots(1, B, figsize=(panel * B, panel + 0.2), squeeze=False)
    for b, ax in enumerate(axes[0]):
        img = images[b]
        grid = maps[b].float().cpu()[None, None]
        att = F.interpolate(grid, size=tuple(img.shape[:2]), mode="nearest")[0, 0]
        ax.imshow(img.numpy(), cmap="gray" if img.dim() == 2 else None)
        ax.imshow(att.numpy(), cmap="inferno", alpha=0.5)
        ax.set_axis_off()
        if titles:
            ax.set_title(titles[b], fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


register_family("vit", ViTConfig, ViT)
register_preset("vit-base", "vit", ViTConfig(), "ViT-B/16, 224x224, 86M (Dosovitskiy et al. 2021)")
register_preset("vit-digits", "vit", ViTConfig(
    image_size=8, patch_size=4, n_channels=1, n_layers=4, d_model=64, n_heads=4, d_ff=128, num_labels=10,
    pooling="mean", dropout=0.1),
                "4 layers, 64 wide, mean-pooled 4x4 patches of 8x8 grey digits (load_digits)")
