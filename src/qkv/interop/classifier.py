"""What the writers of image classifiers (interop/vit.py, swin.py, resnet.py) share: a Hugging Face
*ForImageClassification folder is config.json with the labels, model.safetensors under transformers' names
(the loader's key map, inverted) and preprocessor_config.json saying how the images are prepared.

config.json starts from the source folder's own when it is a Hugging Face folder (every field transformers
reads is kept as the source had it); a qkv model has it written from its config, and a model transformers
cannot hold (a ResNet with the small-image stem, a ViT with mean pooling) is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from qkv.interop.common import export_state, require, write_hf_folder
from qkv.interop.registry import ExportRequest
from qkv.storage import atomic_write_json

HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}  # ours -> transformers'


def transformer_checks(c: Any, what: str) -> None:
    """What the ViT and Swin of transformers fix and a qkv config may vary."""
    require(c.placement == "pre", f"transformers' {what} is Pre-LN; this model's placement is "
                                  f"{c.placement!r}")
    require(c.norm == "layernorm", f"transformers' {what} uses LayerNorm, this model {c.norm!r}")
    require(c.bias and c.qkv_bias in (None, True), f"transformers' {what} has biases on every linear")
    require(not c.qk_norm, f"transformers' {what} has no qk_norm")
    require(c.n_kv_heads in (None, c.n_heads) and c.head_dim in (None, c.d_model // c.n_heads),
            f"transformers' {what} has as many key/value heads as query heads, each d_model / n_heads wide")
    require(c.ffn in HF_ACTIVATIONS, f"transformers' {what} has no {c.ffn!r} MLP")


def classifier_config(request: ExportRequest, architecture: str, config_to_hf: Callable[[], dict[str, Any]],
                      num_labels: int) -> dict[str, Any]:
    """config.json of the classifier: the source's (else `config_to_hf()`, which refuses what transformers
    cannot hold) with `architecture` and the request's labels (numbered without them)."""
    base = request.base_config()
    if base is not None:
        # the weights written are float32 (what the parity checks hold), whatever the source's dtype was
        config = {k: v for k, v in base.items()
                  if k not in ("num_labels", "_name_or_path", "dtype", "torch_dtype")}
    else:
        config = config_to_hf()
    labels = request.labels or {i: f"LABEL_{i}" for i in range(num_labels)}
    config["architectures"] = [architecture]
    config["id2label"] = {str(i): name for i, name in labels.items()}
    config["label2id"] = {name: i for i, name in labels.items()}
    return config


def write_classifier(model: nn.Module, out: Path, config: dict[str, Any], mapping: dict[str, str],
                     preprocessor: dict[str, Any] | None) -> Path:
    """config.json, model.safetensors under `mapping`'s names, in float32, and preprocessor_config.json (when
    given)."""
    state = {k: t.float() if t.is_floating_point() else t
             for k, t in export_state(model.state_dict(), mapping).items()}
    write_hf_folder(out, state, config)
    if preprocessor is not None:
        atomic_write_json(preprocessor, Path(out) / "preprocessor_config.json")
    return Path(out)


def preprocessor_config(image_size: int, mean: list[float], std: list[float]) -> dict[str, Any]:
    """What the training images went through (Pillow: bilinear resize to a square, x 1/255, normalise), as
    the ViTImageProcessor settings that repeat it; qkv predict and transformers read it."""
    return {"image_processor_type": "ViTImageProcessor", "do_resize": True,
            "size": {"height": image_size, "width": image_size}, "resample": 2, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(mean), "image_std": list(std)}


__all__ = ["HF_ACTIVATIONS", "classifier_config", "preprocessor_config", "transformer_checks",
           "write_classifier"]
