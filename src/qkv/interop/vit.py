"""Hugging Face ViTModel / ViTForImageClassification folders -> qkv ViT, by an explicit key map.

HF ViT is Pre-LN with separate query/key/value linears, LayerNorm eps 1e-12, exact-erf GELU, a class token,
learned positions, a final `layernorm`; ViTModel adds a tanh pooler on the class token, the classifier model
has no pooler and a linear `classifier` on the normed class token. Our self-attention fuses Q, K, V into one
Linear, so their weights are concatenated (rows q, then k, then v).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qkv.interop import LOADERS
from qkv.interop.common import load_converted, read_hf_state
from qkv.models.vit import ViT, ViTConfig
from qkv.storage import CheckpointError

_ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


class ReadTensors(dict):
    """A folder's tensors that remember which were read: a loader that picks keys by name would otherwise take
    a folder of another architecture (ViTForMaskedImageModeling's decoder) or with more layers than its
    config.json says without a word."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__(state)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> torch.Tensor:
        self.read.add(key)
        return super().__getitem__(key)

    def check_all_read(self, folder: Path, family: str) -> None:
        unread = sorted(set(self) - self.read)
        if unread:
            more = f" (+{len(unread) - 3} more)" if len(unread) > 3 else ""
            raise CheckpointError(f"{folder}: unexpected key(s) {unread[:3]}{more} in a Hugging Face {family} folder: "
                                  "another architecture or more layers than config.json says")


def read_hf_weights(folder: Path) -> ReadTensors:
    """All tensors of a HF folder (model.safetensors, shards, or a pytorch_model.bin read without running code)."""
    return ReadTensors(read_hf_state(folder)[0])


def hf_activation(name: str) -> str:
    if name not in _ACTS:
        raise CheckpointError(f"unsupported Hugging Face activation {name!r}; supported: {sorted(_ACTS)}")
    return _ACTS[name]


def vit_config_from_hf(meta: dict[str, Any], *, classify: bool, pooler: bool) -> ViTConfig:
    return ViTConfig(
        image_size=meta["image_size"], patch_size=meta["patch_size"], n_channels=meta.get("num_channels", 3),
        n_layers=meta["num_hidden_layers"], d_model=meta["hidden_size"], n_heads=meta["num_attention_heads"],
        d_ff=meta["intermediate_size"], ffn=hf_activation(meta.get("hidden_act", "gelu")),
        norm_eps=meta.get("layer_norm_eps", 1e-12), bias=meta.get("qkv_bias", True), pooling="cls",
        patch_position="learned", head="classify" if classify else "none", pooler=pooler,
        num_labels=len(meta.get("id2label") or {0: 0, 1: 1}), placement="pre",
    )


def vit_state_from_hf(sd: dict[str, torch.Tensor], n_layers: int, prefix: str = "") -> dict[str, torch.Tensor]:
    """HF ViT encoder keys (under `prefix`) -> our keys; the Q/K/V linears are fused into qkv_proj."""
    p = prefix
    out = {
        "cls_emb": sd[f"{p}embeddings.cls_token"],
        "encoder.position.weight": sd[f"{p}embeddings.position_embeddings"],
        "patch_emb.proj.weight": sd[f"{p}embeddings.patch_embeddings.projection.weight"],
        "patch_emb.proj.bias": sd[f"{p}embeddings.patch_embeddings.projection.bias"],
        "encoder.final_norm.weight": sd[f"{p}layernorm.weight"],
        "encoder.final_norm.bias": sd[f"{p}layernorm.bias"],
    }
    for i in range(n_layers):
        h, o = f"{p}encoder.layer.{i}.", f"encoder.blocks.{i}."
        att = h + "attention.attention."
        out[o + "attn.qkv_proj.weight"] = torch.cat([sd[att + f"{n}.weight"] for n in ("query", "key", "value")])
        if att + "query.bias" in sd:
            out[o + "attn.qkv_proj.bias"] = torch.cat([sd[att + f"{n}.bias"] for n in ("query", "key", "value")])
        simple = {
            "attention.output.dense": "attn.out_proj", "intermediate.dense": "ffn.up", "output.dense": "ffn.down",
            "layernorm_before": "norm1", "layernorm_after": "norm2",
        }
        for hf, ours in simple.items():
            for kind in ("weight", "bias"):
                if h + f"{hf}.{kind}" in sd:
                    out[o + f"{ours}.{kind}"] = sd[h + f"{hf}.{kind}"]
    return out


def load_vit(folder: Path, meta: dict[str, Any]) -> ViT:
    sd = read_hf_weights(folder)
    classify = "classifier.weight" in sd
    prefix = "vit." if any(k.startswith("vit.") for k in sd) else ""
    pooler = f"{prefix}pooler.dense.weight" in sd
    cfg = vit_config_from_hf(meta, classify=classify, pooler=pooler)
    if not meta.get("qkv_bias", True):
        raise CheckpointError("ViT folders with qkv_bias=false are not supported (our Block has one bias flag)")
    if pooler and meta.get("pooler_act", "tanh") != "tanh":  # our ViT's pooler is BERT's: dense + tanh
        raise CheckpointError(f"ViT folders whose pooler_act is {meta['pooler_act']!r} are not supported (tanh only)")
    if pooler and meta.get("pooler_output_size", meta["hidden_size"]) != meta["hidden_size"]:
        raise CheckpointError("ViT folders whose pooler_output_size differs from hidden_size are not supported")
    if classify:
        cfg.num_labels = sd["classifier.weight"].shape[0]
    model = ViT(cfg)
    try:
        state = vit_state_from_hf(sd, cfg.n_layers, prefix)
    except KeyError as e:
        raise CheckpointError(f"{folder}: Hugging Face ViT weight {e} is missing") from None
    if pooler:
        state["pooler.weight"] = sd[f"{prefix}pooler.dense.weight"]
        state["pooler.bias"] = sd[f"{prefix}pooler.dense.bias"]
    if classify:
        state["classifier.weight"], state["classifier.bias"] = sd["classifier.weight"], sd["classifier.bias"]
    sd.check_all_read(folder, "ViT")
    load_converted(model, state, {}, f"{folder} (Hugging Face ViT)")  # a bf16 / fp16 folder stays in its dtype
    return model.eval()


LOADERS["vit"] = load_vit
