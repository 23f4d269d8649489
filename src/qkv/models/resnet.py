"""ResNet (He et al. 2016): the convolutional baseline that the vision Transformers are measured against.

pixels (B, C, H, W) -> stem -> stage 1 .. stage S (blocks; each later stage halves the grid, widens)
  -> global average pool -> [dropout] -> classifier -> logits (B, num_labels)

stem "imagenet": 7x7 conv stride 2 + BN + ReLU + 3x3 max-pool stride 2 (224 px images -> a 56x56 grid);
stem "cifar": one 3x3 conv stride 1 + BN + ReLU, no pooling: the usual stem for 28-32 px images, where the
  ImageNet stem would shrink the image to 7x7 before the first block (He et al. 2016, section 4.2).
block "basic": 3x3 conv - BN - ReLU - 3x3 conv - BN, + shortcut, ReLU (ResNet-18/34).
block "bottleneck": 1x1 down to width/4 - 3x3 - 1x1 back up to width, each with BN, + shortcut, ReLU
  (ResNet-50 and deeper); the stride sits on the 3x3 ("v1.5", torchvision's and Hugging Face's default) or on
  the first 1x1 (the paper's v1: stride_in_1x1).
The shortcut is the identity, or a 1x1 conv (stride s) + BN where the block changes the width or the grid
(the paper's option B). Initialisation: Kaiming normal (fan_out, ReLU) for convolutions, BN weight 1 / bias
0; `zero_init_residual` sets the last BN of each residual branch to 0, so every block starts as the identity
(Goyal et al. 2017): it helps large-batch training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.config import ConfigError, check_fields, setting
from qkv.models.base import ModelOutput, QKVModel, class_logits
from qkv.models.registry import register_family, register_preset

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


@dataclass
class ResNetConfig:
    image_size: int = setting(224, "the size the model is trained at (the network itself takes any size)",
                              ge=1)
    n_channels: int = setting(3, "image channels", ge=1)
    stem: Literal["imagenet", "cifar"] = setting(
        "imagenet", "imagenet: 7x7/2 conv + 3x3/2 max-pool; cifar: one 3x3/1 conv, no pooling")
    stem_width: int = setting(64, "the stem's output channels", ge=1)
    block: Literal["basic", "bottleneck"] = setting("basic", "basic (two 3x3 convs) or bottleneck (1x1 - 3x3 "
                                                    "- 1x1)")
    depths: list[int] = setting([2, 2, 2, 2], "blocks per stage, each at least 1 (ResNet-18)")
    widths: list[int] = setting([64, 128, 256, 512], "output channels of each stage, each at least 1")
    bottleneck_reduction: int = setting(4, "a bottleneck's inner width = its output width / this", ge=1)
    stride_in_1x1: bool = setting(False, "bottleneck: downsample in the first 1x1 (v1) rather than the 3x3 "
                                  "(v1.5)")
    downsample_first_stage: bool = setting(False, "stage 1 halves the grid too (never in the paper's "
                                           "ResNets)")
    activation: str = setting("relu", "the activation after each BatchNorm", choices=tuple(ACTIVATIONS))
    zero_init_residual: bool = setting(False, "last BN of every residual branch starts at 0 (each block = "
                                       "identity)")
    norm_eps: float = setting(1e-5, "the BatchNorms' epsilon")
    bn_momentum: float = setting(0.1, "the BatchNorms' running-statistics momentum")
    dropout: float = setting(0.0, "before the classifier", ge=0, lt=1)
    head: Literal["classify", "none"] = setting("classify", "classify (logits over num_labels) or none "
                                                "(pooled features only)")
    num_labels: int = setting(1000, "classes of the classification head", ge=1)

    def validate(self) -> None:
        check_fields(self)
        if not self.depths or len(self.depths) != len(self.widths):
            raise ConfigError(f"ResNetConfig.depths and widths need one entry per stage, got {self.depths} "
                              f"and {self.widths}")
        if any(d < 1 for d in self.depths) or any(w < 1 for w in self.widths):
            raise ConfigError("ResNetConfig.depths and widths must be positive")
        if self.block == "bottleneck" and any(w % self.bottleneck_reduction for w in self.widths):
            raise ConfigError(f"bottleneck widths {self.widths} must be multiples of bottleneck_reduction "
                              f"({self.bottleneck_reduction})")


class ConvBN(nn.Module):
    """k x k conv (no bias: the BN after it has one) + BatchNorm; padding k // 2 keeps the grid at stride
    1."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, cfg: ResNetConfig) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False)
        self.bn = nn.BatchNorm2d(c_out, eps=cfg.norm_eps, momentum=cfg.bn_momentum)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(self.conv(x))


class ResidualBlock(nn.Module):
    """act(branch(x) + shortcut(x)); the branch is basic (3x3, 3x3) or bottleneck (1x1, 3x3, 1x1)."""

    def __init__(self, c_in: int, c_out: int, stride: int, cfg: ResNetConfig) -> None:
        super().__init__()
        if cfg.block == "basic":
            shapes = [(c_in, c_out, 3, stride), (c_out, c_out, 3, 1)]
        else:
            mid = c_out // cfg.bottleneck_reduction
            s1, s3 = (stride, 1) if cfg.stride_in_1x1 else (1, stride)
            shapes = [(c_in, mid, 1, s1), (mid, mid, 3, s3), (mid, c_out, 1, 1)]
        self.branch = nn.ModuleList([ConvBN(*s, cfg) for s in shapes])
        # a 1x1 projection only where the identity cannot be added (width or grid changes)
        self.shortcut = ConvBN(c_in, c_out, 1, stride, cfg) if (c_in != c_out or stride != 1) else None
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for i, layer in enumerate(self.branch):
            h = layer(h)
            if i < len(self.branch) - 1:  # no activation before the sum: it comes after
                h = self.act(h)
        return self.act(h + (self.shortcut(x) if self.shortcut is not None else x))


class Stem(nn.Module):
    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        k, s = (7, 2) if cfg.stem == "imagenet" else (3, 1)
        self.conv = ConvBN(cfg.n_channels, cfg.stem_width, k, s, cfg)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1) if cfg.stem == "imagenet" else nn.Identity()
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.pool(self.act(self.conv(x)))


class ResNet(QKVModel):
    kinds: ClassVar[tuple[str, ...]] = ("image",)

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__(config)
        c = config
        self.stem = Stem(c)
        self.stages = nn.ModuleList()
        c_in = c.stem_width
        for i, (depth, width) in enumerate(zip(c.depths, c.widths)):
            stride = 2 if (i > 0 or c.downsample_first_stage) else 1
            blocks = [ResidualBlock(c_in if j == 0 else width, width, stride if j == 0 else 1, c)
                          for j in range(depth)]
            self.stages.append(nn.ModuleList(blocks))
            c_in = width
        self.head_drop = nn.Dropout(c.dropout)
        self.classifier = nn.Linear(c_in, c.num_labels) if c.head == "classify" else None
        self.reset_parameters()
        # channels_last (NHWC) is the layout oneDNN's and cuDNN's convolutions run fastest on: a training step
        # of ResNet-10 on Fashion-MNIST costs ~20% less CPU than in NCHW (benchmarks/conv_layout.py); the
        # values are the same
        self.to(memory_format=torch.channels_last)

    def reset_parameters(self) -> None:
        """Kaiming normal (fan_out) convs as torchvision; BN (1, 0), or (0, 0) at a branch's end with
        zero_init_residual; the classifier keeps nn.Linear's default (uniform in +-1/sqrt(fan_in))."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if self.config.zero_init_residual:
            for stage in self.stages:
                for block in stage:
                    nn.init.zeros_(block.branch[-1].bn.weight)

    def features(self, pixel_values: Tensor) -> Tensor:
        """The last stage's feature map (B, C, H', W')."""
        c = self.config
        if pixel_values.dim() != 4 or pixel_values.shape[1] != c.n_channels:
            raise ValueError(f"pixel_values must be (B, {c.n_channels}, H, W), got "
                             f"{tuple(pixel_values.shape)}")
        x = self.stem(pixel_values.contiguous(memory_format=torch.channels_last))
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return x

    def forward(self, pixel_values: Tensor, *, labels: Tensor | None = None) -> ModelOutput:
        """pixel_values: (B, C, H, W) floats; labels: (B,) class ids. Returns logits (B, num_labels)."""
        h = self.features(pixel_values)
        pooled = h.mean(dim=(2, 3))  # global average pooling: (B, C)
        logits, loss, n = class_logits(self.classifier, self.head_drop, pooled, labels)
        # handed out in the usual NCHW memory order (as transformers' ResNet returns it): a caller's .view()
        # of the map works; a copy of the last stage's small map, after the pooling that trains
        return ModelOutput(logits=logits, loss=loss, n_targets=n, last_hidden_state=h.contiguous(),
                           pooled=pooled)


def _cifar(depths: list[int], width: int = 64, **kw) -> ResNetConfig:
    return ResNetConfig(image_size=32, stem="cifar", stem_width=width, depths=depths,
                        widths=[width, 2 * width, 4 * width, 8 * width], num_labels=10, **kw)


register_family("resnet", ResNetConfig, ResNet)
register_preset("resnet-18", "resnet", ResNetConfig(),
                "ResNet-18: basic blocks 2-2-2-2, 224x224, 11.7M (He et al. 2016)")
register_preset("resnet-34", "resnet", ResNetConfig(depths=[3, 4, 6, 3]),
                "ResNet-34: basic blocks 3-4-6-3, 21.8M")
register_preset("resnet-50", "resnet", ResNetConfig(block="bottleneck", depths=[3, 4, 6, 3],
                                                    widths=[256, 512, 1024, 2048]),
                "ResNet-50: bottleneck blocks 3-4-6-3 (v1.5), 25.6M")
register_preset("resnet-18-cifar", "resnet", _cifar([2, 2, 2, 2]),
                "ResNet-18 for 28-32 px images: 3x3 stem, no max-pool, 64..512 wide, 11.2M")
register_preset("resnet-18-cifar-slim", "resnet", _cifar([2, 2, 2, 2], width=32),
                "ResNet-18 for 28-32 px images at half width (32..256): 2.8M, for a CPU")
register_preset("resnet-8-cifar", "resnet", ResNetConfig(
    image_size=32, stem="cifar", stem_width=16, depths=[1, 1, 1], widths=[16, 32, 64], num_labels=10),
    "a tiny 3-stage ResNet (16..64 wide, one basic block each) for tests and quick runs")
