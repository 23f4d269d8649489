"""Hugging Face SwinModel / SwinForImageClassification folders -> qkv Swin, by an explicit key map.

The two are the same network: a conv patch embedding + LayerNorm, stages of Pre-LN blocks attending within
(shifted) windows with a learned relative position bias table ((2w-1)^2, heads) indexed the same way, patch
merging (the same 2x2 concatenation order, LayerNorm over 4C, a bias-free Linear to 2C) at the end of every
stage but the last, a final LayerNorm and mean pooling. HF's separate query/key/value linears are
concatenated into our fused qkv_proj; HF's shifted-window mask is additive -100, ours a boolean keep-mask
(the same softmax to float precision).
What our Swin cannot hold is refused by name: heads that do not double from stage to stage (HF takes any
list), absolute position embeddings, a grid that is not a multiple of the window (HF pads it), a non-GELU MLP,
an MLP ratio whose hidden size is not an integer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qkv.interop.classifier import HF_ACTIVATIONS, classifier_config, transformer_checks, write_classifier
from qkv.interop.common import HFTensors, build_skeleton, load_hf_weights, require
from qkv.interop.registry import ExportRequest, ModelType, register
from qkv.interop.vit import LAYER_MAP, hf_activation
from qkv.models.swin import Swin, SwinConfig


def swin_config_from_hf(meta: dict[str, Any], *, classify: bool, num_labels: int) -> SwinConfig:
    heads, depths = list(meta["num_heads"]), list(meta["depths"])
    require(len(heads) == len(depths), f"Swin num_heads {heads} and depths {depths} differ in length")
    require(all(h == heads[0] * 2 ** i for i, h in enumerate(heads)),
            f"Swin folders whose heads do not double per stage are not supported (num_heads {heads})")
    require(not meta.get("use_absolute_embeddings", False),
            "Swin folders with use_absolute_embeddings=true are not supported")
    require(meta.get("qkv_bias", True), "Swin folders with qkv_bias=false are not supported")
    cfg = SwinConfig(
        image_size=meta["image_size"],
        patch_size=meta["patch_size"],
        n_channels=meta.get("num_channels", 3),
        depths=depths,
        window_size=meta["window_size"],
        ffn_ratio=float(meta.get("mlp_ratio", 4.0)),
        d_model=meta["embed_dim"],
        n_heads=heads[0],
        ffn=hf_activation(meta.get("hidden_act", "gelu")),
        norm_eps=meta.get("layer_norm_eps", 1e-5),
        head="classify" if classify else "none",
        num_labels=num_labels,
    )
    require(all(float(cfg.ffn_ratio * cfg.d_model * 2 ** i).is_integer() for i in range(len(depths))),
            f"Swin mlp_ratio {cfg.ffn_ratio} gives a fractional MLP width")
    try:
        cfg.validate()
    except Exception as e:  # a grid HF pads to the window: say so in the loader's words
        require(False, f"this Swin folder's image/patch/window sizes are not supported ({e})")
    return cfg


def swin_key_map(cfg: SwinConfig, prefix: str = "", *, classify: bool = False) -> dict[str, str]:
    p = prefix
    m = {
        f"{p}embeddings.patch_embeddings.projection.weight": "patch_emb.weight",
        f"{p}embeddings.patch_embeddings.projection.bias": "patch_emb.bias",
        f"{p}embeddings.norm.weight": "patch_norm.weight",
        f"{p}embeddings.norm.bias": "patch_norm.bias",
        f"{p}layernorm.weight": "final_norm.weight",
        f"{p}layernorm.bias": "final_norm.bias",
    }
    for i, depth in enumerate(cfg.depths):
        for j in range(depth):
            h, o = f"{p}encoder.layers.{i}.blocks.{j}.", f"stages.{i}.{j}."
            m[f"{h}attention.self.relative_position_bias_table"] = f"{o}rel_bias.table"
            for kind in ("weight", "bias"):
                m.update({f"{h}attention.self.{n}.{kind}": f"{o}block.attn.qkv_proj.{kind}"
                          for n in ("query", "key", "value")})
                m.update({f"{h}{hf}.{kind}": f"{o}block.{ours}.{kind}" for hf, ours in LAYER_MAP.items()})
        if i < len(cfg.depths) - 1:
            d = f"{p}encoder.layers.{i}.downsample."
            m.update(
                {
                    f"{d}reduction.weight": f"merges.{i}.reduction.weight",
                    f"{d}norm.weight": f"merges.{i}.norm.weight",
                    f"{d}norm.bias": f"merges.{i}.norm.bias",
                }
            )
    if classify:
        m.update({"classifier.weight": "classifier.weight", "classifier.bias": "classifier.bias"})
    return m


def load_swin(folder: Path, meta: dict[str, Any]) -> Swin:
    sd = HFTensors(folder)
    classify = "classifier.weight" in sd
    prefix = "swin." if any(k.startswith("swin.") for k in sd) else ""
    num_labels = sd.meta("classifier.weight").shape[0] if classify else len(meta.get("id2label") or {0: 0})
    cfg = swin_config_from_hf(meta, classify=classify, num_labels=num_labels)
    model = build_skeleton(lambda: Swin(cfg))
    # relative_position_index: HF's buffer of the same (dy, dx) indexing, rebuilt by our layers
    load_hf_weights(model, sd, swin_key_map(cfg, prefix, classify=classify), source=sd.source,
                    ignore=[
                        f"{prefix}encoder.layers.{{}}.blocks.{{}}.attention.self.relative_position_index"])
    return model.eval()


def swin_config_to_hf(c: SwinConfig) -> dict[str, Any]:
    """A qkv SwinConfig as transformers' SwinConfig fields (refused where transformers' Swin differs)."""
    transformer_checks(c, "Swin")
    return {"model_type": "swin", "image_size": c.image_size, "patch_size": c.patch_size,
            "num_channels": c.n_channels, "embed_dim": c.d_model, "depths": list(c.depths),
            "num_heads": [c.n_heads * 2 ** i for i in range(len(c.depths))], "window_size": c.window_size,
            "mlp_ratio": c.ffn_ratio, "hidden_act": HF_ACTIVATIONS[c.ffn], "layer_norm_eps": c.norm_eps,
            "qkv_bias": True, "use_absolute_embeddings": False}


def check_swin(model: Swin, request: ExportRequest) -> dict[str, Any]:
    """config.json of `model` as a SwinForImageClassification folder."""
    c = model.config
    return classifier_config(request, "SwinForImageClassification", lambda: swin_config_to_hf(c),
                             c.num_labels)


def write_swin(model: Swin, out: Path, request: ExportRequest) -> None:
    mapping = swin_key_map(model.config, "swin.", classify=True)
    write_classifier(model, out, check_swin(model, request), mapping, request.preprocessor)


register(ModelType("swin", "image", "swin", load_swin, write_swin, check=check_swin))

__all__ = ["load_swin", "swin_config_from_hf", "swin_config_to_hf", "swin_key_map"]
