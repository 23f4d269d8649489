"""DETR (Carion et al. 2020, "End-to-End Object Detection with Transformers"): detection as set prediction.

pixels (B, C, H, W) -> CNN backbone (a qkv ResNet without its head) -> feature map (B, C', H', W')
  -> 1x1 conv to d_model -> flatten to H'W' tokens (+ a 2-D sine position table, added to queries and keys
     only, in every encoder and cross-attention layer)
  -> Transformer encoder (Post-LN layers)
  -> Transformer decoder: num_queries object queries start as zeros; their learned embeddings (the "object
     queries") are added to the decoder's queries and keys of self-attention and to the queries of
     cross-attention in every layer; a final LayerNorm
  -> per query: a Linear to num_labels + 1 classes (the last one is "no object") and a 3-layer MLP to a box
     (cx, cy, w, h) squashed into [0, 1] by a sigmoid, relative to the image

No decoding order, no anchors, no non-maximum suppression: training matches the num_queries predictions to
the targets one-to-one (Hungarian matching, qkv.models.set_loss) and the unmatched ones learn "no object".
With aux_loss every decoder layer's output goes through the shared LayerNorm and heads and is matched and
scored too (the paper's auxiliary decoding losses, §3.2).

Weights of a Hugging Face `detr` folder with transformers' own ResNet backbone load with equal outputs
(qkv.interop.detr); the two settings that folders need are `frozen_bn` (DETR trains its backbone with
frozen BatchNorm statistics and affine terms) and `renorm_intermediate` (see the field).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.config import ConfigError, check_fields, setting
from qkv.models.base import ModelOutput, QKVModel
from qkv.models.registry import register_family, register_preset
from qkv.models.resnet import ResNet, ResNetConfig
from qkv.models.set_loss import SetLossWeights, set_loss
from qkv.nn.attention import scaled_dot_product_attention
from qkv.nn.ffn import UNGATED, FeedForward
from qkv.nn.linear import Linear


@dataclass
class DETRConfig:
    # a 4-stage ResNet 16..128 wide with the 3x3 stem (no max-pool): stride 8, so a 64 px canvas is an 8x8
    # grid of 64 encoder tokens; one grey channel (Fashion-MNIST canvases)
    backbone: ResNetConfig = setting(
        ResNetConfig(image_size=64, n_channels=1, stem="cifar", stem_width=16, depths=[1, 1, 1, 1],
                     widths=[16, 32, 64, 128], head="none"), "the CNN backbone (its head must be none)")
    d_model: int = setting(128, "width of the Transformer; a multiple of 4 (the 2-D sine table) and of the "
                           "heads", ge=1)
    encoder_layers: int = setting(2, "encoder blocks", ge=0)
    decoder_layers: int = setting(2, "decoder blocks", ge=1)
    encoder_heads: int = setting(4, "the encoder's attention heads", ge=1)
    decoder_heads: int = setting(4, "the decoder's attention heads", ge=1)
    encoder_d_ff: int = setting(256, "the encoder's feed-forward hidden size", ge=1)
    decoder_d_ff: int = setting(256, "the decoder's feed-forward hidden size", ge=1)
    activation: str = setting("relu", "of the feed-forward layers", choices=UNGATED)
    dropout: float = setting(0.1, "on every residual branch and inside the feed-forward layers", ge=0, lt=1)
    attn_dropout: float = setting(0.0, "on the attention weights", ge=0, lt=1)
    norm_eps: float = setting(1e-5, "the LayerNorms' epsilon")
    num_queries: int = setting(25, "the most objects one image can hold", ge=1)
    num_labels: int = setting(10, "object classes; the logits have one more, 'no object' (the last)", ge=1)
    box_layers: int = setting(3, "of the box MLP (d_model wide, ReLU between)", ge=1)
    position_temperature: float = setting(10000.0, "the base of the sine table's wavelengths (the "
                                          "Transformer's)")
    aux_loss: bool = setting(True, "every decoder layer's output is scored (auxiliary decoding losses)")
    # transformers' DetrDecoder does this; the original DETR normalises only the copy the heads read
    renorm_intermediate: bool = setting(False, "with aux_loss, the next decoder layer reads the LayerNorm'd "
                                        "output (a Hugging Face folder sets it)")
    frozen_bn: bool = setting(False, "the backbone's BatchNorms are fixed affine maps (DETR fine-tuning; HF "
                              "folders)")
    loss: SetLossWeights = setting(SetLossWeights(), "matching costs and loss weights")

    def validate(self) -> None:
        check_fields(self)
        self.backbone.validate()
        if self.backbone.head != "none":
            raise ConfigError(f"DETRConfig.backbone.head must be 'none' (DETR reads the feature map), got "
                              f"{self.backbone.head!r}")
        if self.d_model % 4:  # half the channels per axis, each half sin/cos pairs
            raise ConfigError(f"DETRConfig.d_model must be a multiple of 4 (the 2-D sine table), got "
                              f"{self.d_model}")
        for name in ("encoder_heads", "decoder_heads"):
            if self.d_model % getattr(self, name):
                raise ConfigError(f"DETRConfig.d_model ({self.d_model}) must be divisible by {name} "
                                  f"({getattr(self, name)})")


@dataclass
class DetectionOutput(ModelOutput):
    """logits (B, Q, num_labels + 1), the last class "no object"; pred_boxes (B, Q, 4) (cx, cy, w, h) in
    [0, 1] of the image; aux_outputs: each earlier decoder layer's (logits, pred_boxes) with aux_loss;
    loss_terms: every term of the set loss when targets were given."""

    pred_boxes: Tensor | None = None
    aux_outputs: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    loss_terms: dict[str, Tensor] = field(default_factory=dict)
    encoder_hidden_state: Tensor | None = None  # (B, H'W', d_model)


def sine_position_embedding(keep: Tensor, d_model: int, temperature: float = 10000.0,
                            dtype: torch.dtype = torch.float32) -> Tensor:
    """DETR's 2-D sine table of a feature map, (B, h * w, d_model), from its (B, h, w) mask of real (not
    padding) positions: the first half of the channels encode the row, the second half the column. A
    position's coordinate is the count of real positions up to it along its column (row), divided by the
    column's (row's) total + 1e-6 and scaled to 2 pi, so the real part of any image spans (0, 2 pi]; then for
    pair k = 0 .. d/4 - 1 the channels 2k, 2k + 1 are sin and cos of it / temperature ** (2k / (d / 2)) (the
    Transformer's table at a normalised position)."""
    npf = d_model // 2
    m = keep.to(dtype)
    y, x = m.cumsum(1), m.cumsum(2)
    y = y / (y[:, -1:, :] + 1e-6) * (2 * math.pi)
    x = x / (x[:, :, -1:] + 1e-6) * (2 * math.pi)
    dim_t = torch.arange(npf, device=keep.device).div(2, rounding_mode="floor").to(dtype)
    dim_t = temperature ** (2 * dim_t / npf)

    def encode(c: Tensor) -> Tensor:  # (B, h, w) -> (B, h, w, npf): sin, cos interleaved per frequency
        a = c[..., None] / dim_t
        return torch.stack((a[..., 0::2].sin(), a[..., 1::2].cos()), dim=-1).flatten(-2)

    return torch.cat([encode(y), encode(x)], dim=-1).flatten(1, 2)


def sine_position_grid(h: int, w: int, d_model: int, temperature: float = 10000.0,
                       device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """The sine table (h * w, d_model) of a map with no padding: row i's coordinate is (i + 1) / (h + 1e-6)
    * 2 pi, column j's (j + 1) / (w + 1e-6) * 2 pi."""
    keep = torch.ones(1, h, w, dtype=torch.bool, device=device)
    return sine_position_embedding(keep, d_model, temperature, dtype)[0]


class FrozenBatchNorm2d(nn.Module):
    """BatchNorm with fixed statistics and affine terms (buffers, not parameters): x * scale + shift, with
    scale = weight / sqrt(running_var + eps). DETR's backbone: batches of a few large images give too noisy
    statistics to train them."""

    def __init__(self, n: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        for name, fill in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
            self.register_buffer(name, torch.full((n,), fill))

    def forward(self, x: Tensor) -> Tensor:
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale[:, None, None] + shift[:, None, None]


def freeze_batch_norms(module: nn.Module) -> None:
    """Every nn.BatchNorm2d under `module` replaced by a FrozenBatchNorm2d holding its values."""
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            frozen = FrozenBatchNorm2d(child.num_features, child.eps)
            with torch.no_grad():
                for k in ("weight", "bias", "running_mean", "running_var"):
                    src = getattr(child, k)
                    if src.device.type != "meta":
                        getattr(frozen, k).copy_(src)
            setattr(module, name, frozen)
        else:
            freeze_batch_norms(child)


class PositionalAttention(nn.Module):
    """Multi-head attention whose position terms go into the queries and keys, never the values (DETR's):
    q = Wq (x + pos_q), k = Wk (memory + pos_k), v = Wv memory."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.q_proj, self.k_proj = Linear(d_model, d_model), Linear(d_model, d_model)
        self.v_proj, self.out_proj = Linear(d_model, d_model), Linear(d_model, d_model)

    def forward(self, x: Tensor, pos_q: Tensor | None, memory: Tensor, pos_k: Tensor | None,
                keep: Tensor | None = None) -> Tensor:
        """keep: (B, S) True where a key is real (not padding), or None (all are)."""
        B, T, C = x.shape
        S = memory.shape[1]

        def heads(t: Tensor, n: int) -> Tensor:  # (B, n, C) -> (B, H, n, C / H)
            return t.view(B, n, self.n_heads, -1).transpose(1, 2)

        q = heads(self.q_proj(x if pos_q is None else x + pos_q), T)
        k = heads(self.k_proj(memory if pos_k is None else memory + pos_k), S)
        v = heads(self.v_proj(memory), S)
        mask = None if keep is None else keep[:, None, None, :]
        y, _ = scaled_dot_product_attention(q, k, v, mask=mask, backend="fused",
                                            dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))


class EncoderLayer(nn.Module):
    """Post-LN: h = norm(h + attn(h + pos, h + pos, h)); h = norm(h + ffn(h))."""

    def __init__(self, cfg: DETRConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.attn = PositionalAttention(d, cfg.encoder_heads, cfg.attn_dropout)
        self.attn_norm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.ffn = FeedForward(d, cfg.encoder_d_ff, cfg.activation, dropout=cfg.dropout)
        self.ffn_norm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, h: Tensor, pos: Tensor, keep: Tensor | None = None) -> Tensor:
        h = self.attn_norm(h + self.drop(self.attn(h, pos, h, pos, keep)))
        return self.ffn_norm(h + self.drop(self.ffn(h)))


class DecoderLayer(nn.Module):
    """Post-LN: self-attention among the queries (object queries added to q, k), cross-attention to the
    encoder (object queries added to q, the sine table to k), feed-forward."""

    def __init__(self, cfg: DETRConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.self_attn = PositionalAttention(d, cfg.decoder_heads, cfg.attn_dropout)
        self.self_norm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.cross_attn = PositionalAttention(d, cfg.decoder_heads, cfg.attn_dropout)
        self.cross_norm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.ffn = FeedForward(d, cfg.decoder_d_ff, cfg.activation, dropout=cfg.dropout)
        self.ffn_norm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, t: Tensor, query_pos: Tensor, memory: Tensor, pos: Tensor,
                keep: Tensor | None = None) -> Tensor:
        t = self.self_norm(t + self.drop(self.self_attn(t, query_pos, t, query_pos)))
        t = self.cross_norm(t + self.drop(self.cross_attn(t, query_pos, memory, pos, keep)))
        return self.ffn_norm(t + self.drop(self.ffn(t)))


class BoxHead(nn.Module):
    """An MLP d_model -> ... -> 4 with ReLU between its layers; the sigmoid comes after (DETR.heads)."""

    def __init__(self, d_model: int, n_layers: int) -> None:
        super().__init__()
        dims = [d_model] * n_layers + [4]
        self.layers = nn.ModuleList(Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


class DETR(QKVModel):
    kinds: ClassVar[tuple[str, ...]] = ("detection",)

    def __init__(self, config: DETRConfig) -> None:
        super().__init__(config)
        c = config
        self.backbone = ResNet(c.backbone)
        if c.frozen_bn:
            freeze_batch_norms(self.backbone)
        self.input_proj = nn.Conv2d(c.backbone.widths[-1], c.d_model, kernel_size=1)
        self.encoder = nn.ModuleList(EncoderLayer(c) for _ in range(c.encoder_layers))
        self.query_embed = nn.Embedding(c.num_queries, c.d_model)
        self.decoder = nn.ModuleList(DecoderLayer(c) for _ in range(c.decoder_layers))
        self.decoder_norm = nn.LayerNorm(c.d_model, eps=c.norm_eps)
        self.class_head = Linear(c.d_model, c.num_labels + 1)
        self.box_head = BoxHead(c.d_model, c.box_layers)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The Transformer's matrices Xavier-uniform and its biases zero (DETR's init); the backbone keeps
        its own (Kaiming), the object queries N(0, 1) (nn.Embedding's)."""
        for part in (self.encoder, self.decoder, self.box_head):
            for name, p in part.named_parameters():
                if p.dim() > 1:
                    nn.init.xavier_uniform_(p)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)

    @classmethod
    def config_for_task(cls, kind: str, needs: dict[str, Any]) -> dict[str, Any]:
        """A detection task's image size and channels go to the backbone; its classes to num_labels."""
        out = {k: v for k, v in needs.items() if k not in ("image_size", "n_channels")}
        out.update({f"backbone.{k}": needs[k] for k in ("image_size", "n_channels") if k in needs})
        return out

    def check_pixels(self, pixel_values: Tensor, pixel_mask: Tensor | None = None) -> None:
        n = self.config.backbone.n_channels
        if pixel_values.dim() != 4 or pixel_values.shape[1] != n:
            raise ValueError(f"DETR: pixel_values must be (B, {n}, H, W) (this model's backbone takes {n} "
                             f"channel{'s' if n > 1 else ''}), got shape {tuple(pixel_values.shape)}")
        if not pixel_values.is_floating_point():
            raise ValueError(f"DETR: pixel_values must be floats, got {pixel_values.dtype}")
        want = (pixel_values.shape[0], *pixel_values.shape[2:])
        if pixel_mask is not None and tuple(pixel_mask.shape) != want:
            raise ValueError(f"DETR: pixel_mask must be (B, H, W) = {want} like pixel_values, got shape "
                             f"{tuple(pixel_mask.shape)}")

    def feature_keep(self, pixel_mask: Tensor | None, h: int, w: int) -> Tensor | None:
        """The pixel mask (B, H, W) (1 = real, 0 = padding) taken to the feature grid (B, h, w) by nearest
        neighbours, as transformers does; None without padding."""
        if pixel_mask is None:
            return None
        return F.interpolate(pixel_mask[None].float(), size=(h, w))[0].bool()

    def encode(self, pixel_values: Tensor, pixel_mask: Tensor | None = None
               ) -> tuple[Tensor, Tensor, Tensor | None]:
        """(the encoder's output (B, H'W', d_model), the sine table it was built with ((H'W', d_model), or
        (B, H'W', d_model) with a pixel mask), which of the H'W' positions are real (B, H'W') or None)."""
        feats = self.input_proj(self.backbone.features(pixel_values))  # (B, d, H', W')
        B, d, h, w = feats.shape
        keep = self.feature_keep(pixel_mask, h, w)
        if keep is None:
            pos = sine_position_grid(h, w, d, self.config.position_temperature, feats.device, feats.dtype)
        else:
            pos = sine_position_embedding(keep, d, self.config.position_temperature, feats.dtype)
            keep = keep.flatten(1)
        x = feats.flatten(2).transpose(1, 2)  # (B, H'W', d)
        for layer in self.encoder:
            x = layer(x, pos, keep)
        return x, pos, keep

    def decode(self, memory: Tensor, pos: Tensor, keep: Tensor | None = None) -> list[Tensor]:
        """The decoder's normalised outputs (B, Q, d): the last layer's, preceded by every earlier layer's
        with aux_loss. keep: which memory positions are real (B, H'W'), or None (all)."""
        c = self.config
        query_pos = self.query_embed.weight.unsqueeze(0).expand(memory.shape[0], -1, -1)
        t = torch.zeros_like(query_pos)
        outs = []
        for i, layer in enumerate(self.decoder):
            t = layer(t, query_pos, memory, pos, keep)
            if c.aux_loss and i < len(self.decoder) - 1:
                normed = self.decoder_norm(t)
                outs.append(normed)
                if c.renorm_intermediate:
                    t = normed
        if c.aux_loss and c.renorm_intermediate:  # the last layer's output is normalised twice there
            t = self.decoder_norm(t)
        outs.append(self.decoder_norm(t))
        return outs

    def heads(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """(class logits (..., num_labels + 1), boxes (..., 4) (cx, cy, w, h) in [0, 1])."""
        return self.class_head(h), self.box_head(h).sigmoid()

    def forward(self, pixel_values: Tensor, *, pixel_mask: Tensor | None = None,
                labels: list[dict[str, Tensor]] | None = None) -> DetectionOutput:
        """pixel_values (B, C, H, W) floats; pixel_mask (optional) (B, H, W), 1 on an image's pixels and 0 on
        the padding that brought images of different sizes to one batch (keys there are not attended, the
        sine table counts real positions only); labels (optional): per image {"class_labels": (M,) ids in
        [0, num_labels), "boxes": (M, 4) (cx, cy, w, h) in [0, 1]}, M >= 0. The loss is set_loss's total."""
        self.check_pixels(pixel_values, pixel_mask)
        memory, pos, keep = self.encode(pixel_values, pixel_mask)
        hs = self.decode(memory, pos, keep)
        logits, boxes = self.heads(hs[-1])
        out = DetectionOutput(logits=logits, pred_boxes=boxes, last_hidden_state=hs[-1],
                              encoder_hidden_state=memory, aux_outputs=[self.heads(h) for h in hs[:-1]])
        if labels is not None:
            out.loss, out.loss_terms = self.loss(out, labels)
        return out

    def loss(self, out: DetectionOutput, labels: list[dict[str, Tensor]]) -> tuple[Tensor, dict[str, Tensor]]:
        """(the weighted total, every term) of DETR's set loss (qkv.models.set_loss), the auxiliary layers'
        terms suffixed _0, _1, ... when aux_loss is on."""
        n = self.config.num_labels
        for k, t in enumerate(labels):
            ids = t["class_labels"]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
                raise ValueError(f"DETR: labels[{k}] class_labels must be in [0, {n}), got {ids.tolist()}")
        return set_loss(out.logits, out.pred_boxes, labels, self.config.loss, aux=out.aux_outputs or None)


register_family("detr", DETRConfig, DETR)
register_preset("detr-small", "detr", DETRConfig(),
                "a small DETR for 64 px grey canvases: ResNet 16..128 (stride 8), d_model 128, 2+2 layers, "
                "25 queries, auxiliary losses")

__all__ = ["DETR", "DETRConfig", "DetectionOutput", "FrozenBatchNorm2d", "sine_position_embedding",
           "sine_position_grid"]
