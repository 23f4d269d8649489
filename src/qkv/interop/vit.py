"""Hugging Face ViTModel / ViTForImageClassification folders -> qkv ViT, by an explicit key map.

HF ViT is Pre-LN with separate query/key/value linears, LayerNorm eps 1e-12, exact-erf GELU, a class token,
learned positions, a final `layernorm`; ViTModel adds a tanh pooler on the class token, the classifier model
has no pooler and a linear `classifier` on the normed class token. Our self-attention fuses Q, K, V into one
Linear, so their weights are concatenated (rows q, then k, then v).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qkv.interop.bert import ACTIVATIONS
from qkv.interop.classifier import HF_ACTIVATIONS, classifier_config, transformer_checks, write_classifier
from qkv.interop.common import HFTensors, build_skeleton, check_sizes, load_hf_weights, require
from qkv.interop.registry import ExportRequest, ModelType, register
from qkv.models.vit import ViT, ViTConfig
from qkv.storage import CheckpointError


def hf_activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise CheckpointError(f"unsupported Hugging Face activation {name!r}; supported: "
                              f"{sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def vit_config_from_hf(meta: dict[str, Any], *, classify: bool, pooler: bool) -> ViTConfig:
    return ViTConfig(
        image_size=meta["image_size"], patch_size=meta["patch_size"], n_channels=meta.get("num_channels", 3),
        n_layers=meta["num_hidden_layers"], d_model=meta["hidden_size"], n_heads=meta["num_attention_heads"],
        d_ff=meta["intermediate_size"], ffn=hf_activation(meta.get("hidden_act", "gelu")),
        norm_eps=meta.get("layer_norm_eps", 1e-12), bias=meta.get("qkv_bias", True), pooling="cls",
        patch_position="learned", head="classify" if classify else "none", pooler=pooler,
        num_labels=len(meta.get("id2label") or {0: 0, 1: 1}), placement="pre",
    )


# a layer's tensors besides q, k and v: Hugging Face ViT's and Swin's names -> ours
LAYER_MAP = {"attention.output.dense": "attn.out_proj", "intermediate.dense": "ffn.up",
             "output.dense": "ffn.down", "layernorm_before": "norm1", "layernorm_after": "norm2"}


def vit_key_map(
    n_layers: int, prefix: str = "", *, pooler: bool = False, classify: bool = False
) -> dict[str, str]:
    """HF ViT keys (the encoder under `prefix`) -> ours; query/key/value map to one qkv_proj (concatenated in
    that order). Every key is required: a folder with keys this map does not use (another architecture, more
    layers than config.json says) is refused by load_hf_weights, as one with keys missing."""
    p = prefix
    m = {
        f"{p}embeddings.cls_token": "cls_emb",
        f"{p}embeddings.position_embeddings": "encoder.position.weight",
        f"{p}embeddings.patch_embeddings.projection.weight": "patch_emb.proj.weight",
        f"{p}embeddings.patch_embeddings.projection.bias": "patch_emb.proj.bias",
        f"{p}layernorm.weight": "encoder.final_norm.weight",
        f"{p}layernorm.bias": "encoder.final_norm.bias",
    }
    for i in range(n_layers):
        h, o = f"{p}encoder.layer.{i}.", f"encoder.blocks.{i}."
        for kind in ("weight", "bias"):
            m.update(
                {
                    f"{h}attention.attention.{n}.{kind}": f"{o}attn.qkv_proj.{kind}"
                    for n in ("query", "key", "value")
                }
            )
            m.update({f"{h}{hf}.{kind}": f"{o}{ours}.{kind}" for hf, ours in LAYER_MAP.items()})
    if pooler:
        m.update({f"{p}pooler.dense.weight": "pooler.weight", f"{p}pooler.dense.bias": "pooler.bias"})
    if classify:
        m.update({"classifier.weight": "classifier.weight", "classifier.bias": "classifier.bias"})
    return m


def load_vit(folder: Path, meta: dict[str, Any]) -> ViT:
    sd = HFTensors(folder)  # names, shapes and dtypes now; each tensor read when it is copied
    classify = "classifier.weight" in sd
    prefix = "vit." if any(k.startswith("vit.") for k in sd) else ""
    pooler = f"{prefix}pooler.dense.weight" in sd
    cfg = vit_config_from_hf(meta, classify=classify, pooler=pooler)
    if not meta.get("qkv_bias", True):
        raise CheckpointError(
            "ViT folders with qkv_bias=false are not supported (our Block has one bias flag)"
        )
    if pooler and meta.get("pooler_act", "tanh") != "tanh":  # our ViT's pooler is BERT's: dense + tanh
        raise CheckpointError(
            f"ViT folders whose pooler_act is {meta['pooler_act']!r} are not supported (tanh only)"
        )
    if pooler and meta.get("pooler_output_size", meta["hidden_size"]) != meta["hidden_size"]:
        raise CheckpointError(
            "ViT folders whose pooler_output_size differs from hidden_size are not supported"
        )
    if classify:
        cfg.num_labels = sd.meta("classifier.weight").shape[0]
    e, proj = f"{prefix}encoder.layer.", f"{prefix}embeddings.patch_embeddings.projection.weight"
    check_sizes(
        sd,
        sd.source,
        [
            ("num_hidden_layers", cfg.n_layers, e + "{}.layernorm_before.weight", None),
            ("hidden_size", cfg.d_model, proj, 0),
            ("num_channels", cfg.n_channels, proj, 1),
            ("patch_size", cfg.patch_size, proj, 2),
            ("intermediate_size", cfg.d_ff, e + "0.intermediate.dense.weight", 0),
            (
                "(image_size / patch_size)**2 + 1",
                cfg.grid**2 + 1,
                f"{prefix}embeddings.position_embeddings",
                1,
            ),
        ],
    )
    model = build_skeleton(lambda: ViT(cfg))  # parameters on meta: storage comes in the file's dtype
    # a bf16 / fp16 folder stays in its dtype
    load_hf_weights(
        model, sd, vit_key_map(cfg.n_layers, prefix, pooler=pooler, classify=classify), source=sd.source
    )
    return model.eval()


def vit_config_to_hf(c: ViTConfig) -> dict[str, Any]:
    """A qkv ViTConfig as transformers' ViTConfig fields (refused when transformers' ViT cannot hold it)."""
    transformer_checks(c, "ViT")
    require(c.pooling == "cls" and c.patch_position == "learned" and not c.pooler,
            "transformers' ViT classifier reads a class token with learned positions and no pooler; this "
            f"model has pooling={c.pooling!r}, patch_position={c.patch_position!r}, pooler={c.pooler}")
    return {"model_type": "vit", "image_size": c.image_size, "patch_size": c.patch_size,
            "num_channels": c.n_channels, "num_hidden_layers": c.n_layers, "hidden_size": c.d_model,
            "num_attention_heads": c.n_heads, "intermediate_size": c.d_ff,
            "hidden_act": HF_ACTIVATIONS[c.ffn], "layer_norm_eps": c.norm_eps, "qkv_bias": True}


def check_vit(model: ViT, request: ExportRequest) -> dict[str, Any]:
    """config.json of `model` as a ViTForImageClassification folder (refused when transformers cannot hold
    it)."""
    c = model.config
    return classifier_config(request, "ViTForImageClassification", lambda: vit_config_to_hf(c), c.num_labels)


def write_vit(model: ViT, out: Path, request: ExportRequest) -> None:
    mapping = vit_key_map(model.config.n_layers, "vit.", pooler=False, classify=True)
    write_classifier(model, out, check_vit(model, request), mapping, request.preprocessor)


register(ModelType("vit", "image", "vit", load_vit, write_vit, check=check_vit))
