"""Hugging Face ResNetModel / ResNetForImageClassification folders <-> qkv ResNet, by an explicit key map.

HF's ResNet is torchvision's: a 7x7/2 conv + BN + act + 3x3/2 max-pool stem (`embedder`), stages of basic or
bottleneck layers (`layer.k` = conv + BN [+ act], the last without act), a 1x1 conv + BN shortcut where the
width or stride changes, global average pooling, and `classifier.1` (a Linear behind a Flatten). Every
BatchNorm brings its running mean / variance and batch counter. The config's names map one to one:
embedding_size -> stem_width, hidden_sizes -> widths, layer_type -> block, downsample_in_bottleneck ->
stride_in_1x1, downsample_in_first_stage -> downsample_first_stage; the bottleneck reduction is 4.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from qkv.interop.classifier import classifier_config, write_classifier
from qkv.interop.common import (
    HFTensors,
    build_skeleton,
    export_state,
    load_hf_weights,
    require,
    write_hf_folder,
)
from qkv.interop.registry import ExportRequest, ModelType, register
from qkv.models.resnet import ResNet, ResNetConfig
from qkv.storage import CheckpointError

BN_KEYS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def resnet_config_from_hf(meta: dict[str, Any], *, classify: bool, num_labels: int) -> ResNetConfig:
    act = meta.get("hidden_act", "relu")
    if (
        act != "relu"
    ):  # transformers applies it to the stem and after each sum, the branch's inner ones stay ReLU
        raise CheckpointError(
            f"ResNet folders with hidden_act {act!r} are not supported (relu only: transformers "
            "uses it for the stem and after each residual sum but ReLU inside the branches)"
        )
    if meta.get("layer_type", "bottleneck") not in ("basic", "bottleneck"):
        raise CheckpointError(f"unsupported ResNet layer_type {meta['layer_type']!r} (basic or bottleneck)")
    return ResNetConfig(
        n_channels=meta.get("num_channels", 3),
        stem="imagenet",
        stem_width=meta["embedding_size"],
        block=meta.get("layer_type", "bottleneck"),
        depths=list(meta["depths"]),
        widths=list(meta["hidden_sizes"]),
        stride_in_1x1=bool(meta.get("downsample_in_bottleneck", False)),
        downsample_first_stage=bool(meta.get("downsample_in_first_stage", False)),
        activation="relu",
        head="classify" if classify else "none",
        num_labels=num_labels,
    )


def _conv_bn(hf: str, ours: str) -> dict[str, str]:
    """One HF ResNetConvLayer / ResNetShortCut (convolution + normalization) -> our ConvBN."""
    m = {f"{hf}.convolution.weight": f"{ours}.conv.weight"}
    m.update({f"{hf}.normalization.{k}": f"{ours}.bn.{k}" for k in BN_KEYS})
    return m


def resnet_key_map(model: ResNet, prefix: str = "") -> dict[str, str]:
    """HF keys -> ours for this model's shape (which blocks have a projection shortcut comes from the
    model)."""
    p = prefix
    m = _conv_bn(f"{p}embedder.embedder", "stem.conv")
    for s, stage in enumerate(model.stages):
        for b, block in enumerate(stage):
            hf, ours = f"{p}encoder.stages.{s}.layers.{b}", f"stages.{s}.{b}"
            for k in range(len(block.branch)):
                m.update(_conv_bn(f"{hf}.layer.{k}", f"{ours}.branch.{k}"))
            if block.shortcut is not None:
                m.update(_conv_bn(f"{hf}.shortcut", f"{ours}.shortcut"))
    if model.classifier is not None:
        m.update({"classifier.1.weight": "classifier.weight", "classifier.1.bias": "classifier.bias"})
    return m


def load_resnet(folder: Path, meta: dict[str, Any]) -> ResNet:
    sd = HFTensors(folder)  # names, shapes and dtypes now; each tensor read when it is copied
    classify = "classifier.1.weight" in sd
    prefix = "resnet." if any(k.startswith("resnet.") for k in sd) else ""
    num_labels = sd.meta("classifier.1.weight").shape[0] if classify else len(meta.get("id2label") or {0: 0})
    cfg = resnet_config_from_hf(meta, classify=classify, num_labels=num_labels)
    model = build_skeleton(lambda: ResNet(cfg))  # parameters on meta: storage comes in the file's dtype
    load_hf_weights(model, sd, resnet_key_map(model, prefix), source=sd.source)
    return model.eval()


def resnet_config_to_hf(config: ResNetConfig, id2label: dict[int, str] | None = None) -> dict[str, Any]:
    c = config
    require(
        c.stem == "imagenet",
        f"a ResNet with the {c.stem!r} stem cannot be a Hugging Face ResNet folder (its "
        "stem is always the 7x7/2 conv + 3x3/2 max-pool)",
    )
    require(c.block == "basic" or c.bottleneck_reduction == 4,
            f"Hugging Face's bottleneck reduces by 4, this model by {c.bottleneck_reduction}")
    require(c.norm_eps == 1e-5, f"Hugging Face's BatchNorm eps is 1e-5, this model's {c.norm_eps}")
    require(
        c.activation == "relu",
        f"a ResNet with activation {c.activation!r} cannot be exported (transformers' "
        "ResNet keeps ReLU inside its branches whatever hidden_act says)",
    )
    labels = id2label or {i: f"LABEL_{i}" for i in range(c.num_labels)}
    require(len(labels) == c.num_labels, f"{len(labels)} labels for a {c.num_labels}-way classifier")
    return {
        "architectures": ["ResNetForImageClassification" if c.head == "classify" else "ResNetModel"],
        "model_type": "resnet", "num_channels": c.n_channels, "embedding_size": c.stem_width,
        "hidden_sizes": list(c.widths), "depths": list(c.depths), "layer_type": c.block,
        "hidden_act": c.activation, "downsample_in_first_stage": c.downsample_first_stage,
        "downsample_in_bottleneck": c.stride_in_1x1,
        "id2label": {str(i): name for i, name in labels.items()},
        "label2id": {name: i for i, name in labels.items()},
    }


def export_resnet(model: ResNet, path: str | os.PathLike, id2label: dict[int, str] | None = None) -> Path:
    """Write `model` as a Hugging Face ResNet folder (config.json + model.safetensors) that transformers
    loads as ResNetForImageClassification (or ResNetModel without a classifier)."""
    hf_config = resnet_config_to_hf(model.config, id2label)
    prefix = "resnet." if model.classifier is not None else ""
    state = export_state(model.state_dict(), resnet_key_map(model, prefix))
    return write_hf_folder(path, state, hf_config)


def check_resnet(model: ResNet, request: ExportRequest) -> dict[str, Any]:
    """config.json of `model` as a ResNetForImageClassification folder."""
    c = model.config
    return classifier_config(request, "ResNetForImageClassification", lambda: resnet_config_to_hf(c),
                             c.num_labels)


def write_resnet(model: ResNet, out: Path, request: ExportRequest) -> None:
    write_classifier(model, out, check_resnet(model, request), resnet_key_map(model, "resnet."),
                     request.preprocessor)


register(ModelType("resnet", "image", "resnet", load_resnet, write_resnet, check=check_resnet))

__all__ = ["export_resnet", "load_resnet", "resnet_config_from_hf", "resnet_config_to_hf", "resnet_key_map"]
