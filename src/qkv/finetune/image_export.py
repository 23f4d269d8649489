"""Writing a fine-tuned image classifier (qkv ViT, ResNet or Swin) as a Hugging Face folder: config.json with
the new labels, model.safetensors under transformers' *ForImageClassification names (the interop key maps,
inverted), and preprocessor_config.json saying how the training images were prepared.

The config starts from the source folder's own config.json when it is a Hugging Face folder (every field
transformers reads is kept as the source had it); a qkv run's model has its config written from ours, and a
model transformers cannot hold (a ResNet with the small-image stem, a ViT with mean pooling) is refused by
name before training starts (check_exportable).

Not a recipe itself (it registers nothing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qkv.config import ConfigError
from qkv.interop.common import export_state, require, write_hf_folder
from qkv.interop.resnet import resnet_config_to_hf, resnet_key_map
from qkv.interop.swin import swin_key_map
from qkv.interop.vit import vit_key_map
from qkv.storage import atomic_write_json

ARCHITECTURES = {"vit": "ViTForImageClassification", "resnet": "ResNetForImageClassification",
                 "swin": "SwinForImageClassification"}
PREFIX = {"vit": "vit.", "resnet": "resnet.", "swin": "swin."}  # the backbone's name under the classifier
_HF_ACTS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}


def family_of(model: Any) -> str:
    """vit, resnet or swin, from the model's class."""
    name = type(model).__name__.lower()
    if name not in ARCHITECTURES:
        raise ConfigError(f"--task image-classify fine-tunes ViT, ResNet and Swin classifiers, not "
                          f"{type(model).__name__}")
    return name


def _transformer_checks(c: Any, what: str) -> None:
    """What the ViT and Swin of transformers fix and a qkv config may vary."""
    require(c.placement == "pre", f"transformers' {what} is Pre-LN; this model's placement is "
                                  f"{c.placement!r}")
    require(c.norm == "layernorm", f"transformers' {what} uses LayerNorm, this model {c.norm!r}")
    require(c.bias and c.qkv_bias in (None, True), f"transformers' {what} has biases on every linear")
    require(not c.qk_norm, f"transformers' {what} has no qk_norm")
    require(c.n_kv_heads in (None, c.n_heads) and c.head_dim in (None, c.d_model // c.n_heads),
            f"transformers' {what} has as many key/value heads as query heads, each d_model / n_heads wide")
    require(c.ffn in _HF_ACTS, f"transformers' {what} has no {c.ffn!r} MLP")


def vit_config_to_hf(c: Any) -> dict[str, Any]:
    """A qkv ViTConfig as transformers' ViTConfig fields (refused when transformers' ViT cannot hold it)."""
    _transformer_checks(c, "ViT")
    require(c.pooling == "cls" and c.patch_position == "learned" and not c.pooler,
            "transformers' ViT classifier reads a class token with learned positions and no pooler; this "
            f"model has pooling={c.pooling!r}, patch_position={c.patch_position!r}, pooler={c.pooler}")
    return {"model_type": "vit", "image_size": c.image_size, "patch_size": c.patch_size,
            "num_channels": c.n_channels, "num_hidden_layers": c.n_layers, "hidden_size": c.d_model,
            "num_attention_heads": c.n_heads, "intermediate_size": c.d_ff, "hidden_act": _HF_ACTS[c.ffn],
            "layer_norm_eps": c.norm_eps, "qkv_bias": True}


def swin_config_to_hf(c: Any) -> dict[str, Any]:
    """A qkv SwinConfig as transformers' SwinConfig fields."""
    _transformer_checks(c, "Swin")
    return {"model_type": "swin", "image_size": c.image_size, "patch_size": c.patch_size,
            "num_channels": c.n_channels, "embed_dim": c.d_model, "depths": list(c.depths),
            "num_heads": [c.n_heads * 2 ** i for i in range(len(c.depths))], "window_size": c.window_size,
            "mlp_ratio": c.ffn_ratio, "hidden_act": _HF_ACTS[c.ffn], "layer_norm_eps": c.norm_eps,
            "qkv_bias": True, "use_absolute_embeddings": False}


def hf_config(model: Any, base: dict[str, Any] | None, id2label: dict[int, str]) -> dict[str, Any]:
    """config.json of the exported classifier: the source's (or one written from the qkv config) with the
    architecture and labels of this one."""
    family = family_of(model)
    if base is not None:
        # the weights written are float32 (the recipe trains in float32), whatever the source's dtype was
        config = {k: v for k, v in base.items()
                  if k not in ("num_labels", "_name_or_path", "dtype", "torch_dtype")}
    elif family == "resnet":
        config = resnet_config_to_hf(model.config)
    else:
        config = (vit_config_to_hf if family == "vit" else swin_config_to_hf)(model.config)
    config["architectures"] = [ARCHITECTURES[family]]
    config["id2label"] = {str(i): name for i, name in id2label.items()}
    config["label2id"] = {name: i for i, name in id2label.items()}
    return config


def check_exportable(model: Any, base: dict[str, Any] | None) -> None:
    """Refuse, before any training, a model the end of the run could not write as a Hugging Face folder."""
    hf_config(model, base, {0: "a"})


def key_map(model: Any) -> dict[str, str]:
    """transformers' keys of the classifier -> ours (the loaders' maps, with the backbone's prefix)."""
    family, c = family_of(model), model.config
    if family == "vit":
        return vit_key_map(c.n_layers, PREFIX[family], pooler=False, classify=True)
    if family == "resnet":
        return resnet_key_map(model, PREFIX[family])

    return swin_key_map(c, PREFIX[family], classify=True)


def preprocessor_config(image_size: int, mean: list[float], std: list[float]) -> dict[str, Any]:
    """What the training images went through (Pillow: bilinear resize to a square, x 1/255, normalise), as
    the ViTImageProcessor settings that repeat it; qkv predict and transformers read it."""
    return {"image_processor_type": "ViTImageProcessor", "do_resize": True,
            "size": {"height": image_size, "width": image_size}, "resample": 2, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(mean), "image_std": list(std)}


def export_classifier(model: Any, out: Path, base: dict[str, Any] | None, id2label: dict[int, str],
                      preprocessor: dict[str, Any]) -> Path:
    """`model` as a Hugging Face image-classification folder in `out` (each file written atomically)."""
    state = export_state(model.state_dict(), key_map(model))
    write_hf_folder(out, state, hf_config(model, base, id2label))
    atomic_write_json(preprocessor, Path(out) / "preprocessor_config.json")
    return Path(out)


__all__ = ["check_exportable", "export_classifier", "family_of", "hf_config", "preprocessor_config",
           "swin_config_to_hf", "vit_config_to_hf"]
