"""Hugging Face DetrForObjectDetection folders -> qkv DETR, by an explicit key map.

The two are the same network: transformers' own ResNet as the backbone (its BatchNorms frozen: weight, bias
and running statistics as buffers, no batch counter), the last requested stage's map through a 1x1
`input_projection`, the 2-D sine table (d_model / 2 features per axis, normalised, temperature 10000) added
to queries and keys only, Post-LN encoder and decoder layers, `query_position_embeddings` added in every
decoder layer, a final decoder LayerNorm, `class_labels_classifier` (num_labels + 1) and the 3-layer
`bbox_predictor` under a sigmoid. The folder's backbone config is read by interop/resnet.py's rules and its
stages are kept up to the one DETR reads (out_features).

The file's names are transformers' saved ones (`backbone.conv_encoder.model`, `out_proj`, `layers.N.fc1`);
the names transformers 5 uses in memory (`backbone.model`, `o_proj`, `layers.N.mlp.fc1`) load too.
`auxiliary_loss: true` changes what transformers' decoder computes (each layer's output is LayerNorm'd
before the next layer reads it): DETRConfig.renorm_intermediate follows it.
Refused by name: a timm backbone (`use_timm_backbone`, or backbone_config of model_type timm_backbone: its
weights are timm's, not this ResNet's), learned position embeddings, dilation, DetrForSegmentation folders.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from qkv.interop.bart import ACTIVATIONS
from qkv.interop.common import HFTensors, build_skeleton, check_sizes, load_hf_weights, require
from qkv.interop.registry import ModelType, register
from qkv.interop.resnet import resnet_config_from_hf, resnet_key_map
from qkv.models.detr import DETR, DETRConfig
from qkv.models.set_loss import SetLossWeights
from qkv.storage import CheckpointError

BACKBONE = "model.backbone.conv_encoder.model."  # the saved name of transformers' backbone module
# DetrConfig's matching costs and loss weights -> SetLossWeights'
LOSS_FIELDS = {"class_cost": "class_cost", "bbox_cost": "bbox_cost", "giou_cost": "giou_cost",
               "bbox_loss_coefficient": "bbox", "giou_loss_coefficient": "giou",
               "eos_coefficient": "eos_coef"}
# one encoder / decoder layer: HF module -> ours (a norm or Linear: weight and bias; an attention: its four)
ENCODER_LAYER = {"self_attn": "attn", "self_attn_layer_norm": "attn_norm", "fc1": "ffn.up", "fc2": "ffn.down",
                 "final_layer_norm": "ffn_norm"}
DECODER_LAYER = {"self_attn": "self_attn", "self_attn_layer_norm": "self_norm", "encoder_attn": "cross_attn",
                 "encoder_attn_layer_norm": "cross_norm", "fc1": "ffn.up", "fc2": "ffn.down",
                 "final_layer_norm": "ffn_norm"}
HEADS = {"model.input_projection": "input_proj", "model.decoder.layernorm": "decoder_norm",
         "class_labels_classifier": "class_head"}


def backbone_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """The folder's ResNet backbone config, or a CheckpointError saying why there is none we can load."""
    timm = ("are not supported: their weights are timm's ResNet; load a folder saved with "
            "use_timm_backbone=false (transformers' own ResNet, backbone_config)")
    bb = meta.get("backbone_config")
    if bb is None:
        require(not meta.get("use_timm_backbone", True),
                f"DETR folders with a timm backbone (use_timm_backbone, {meta.get('backbone')!r}) {timm}")
        raise CheckpointError("this DETR folder's config.json has no backbone_config")
    require(isinstance(bb, dict), f"DETR backbone_config must be a mapping, got {bb!r}")
    bb_type = bb.get("model_type")
    require(bb_type != "timm_backbone",
            f"DETR folders with a timm backbone (backbone_config.model_type 'timm_backbone', "
            f"{bb.get('backbone')!r}) {timm}")
    require(bb_type == "resnet",
            f"DETR with a {bb_type!r} backbone is not supported (transformers' resnet only)")
    return bb


def read_stage(bb: dict[str, Any]) -> int:
    """How many ResNet stages DETR runs: up to the last of out_features ("stageK", K from 1)."""
    n = len(bb["depths"])
    names = bb.get("out_features") or [f"stage{n}"]
    m = re.fullmatch(r"stage(\d+)", str(names[-1]))
    require(m is not None and 1 <= int(m.group(1)) <= n,
            f"DETR backbone out_features {names} must end with one of stage1 .. stage{n}")
    return int(m.group(1))


def detr_config_from_hf(meta: dict[str, Any], num_labels: int) -> DETRConfig:
    bb = backbone_meta(meta)
    require(meta.get("position_embedding_type", "sine") == "sine",
            f"DETR position_embedding_type {meta.get('position_embedding_type')!r} is not supported (sine)")
    require(not meta.get("dilation"), "DETR folders with dilation (DC5) are not supported")
    act = meta.get("activation_function", "relu")
    require(act in ACTIVATIONS, f"DETR activation_function {act!r} is not supported; supported: "
                                f"{sorted(ACTIVATIONS)}")
    backbone = resnet_config_from_hf(bb, classify=False, num_labels=1)
    k = read_stage(bb)
    backbone.depths, backbone.widths = backbone.depths[:k], backbone.widths[:k]
    require(backbone.n_channels == meta.get("num_channels", 3),
            f"DETR num_channels {meta.get('num_channels')} but its backbone takes {backbone.n_channels}")
    aux = bool(meta.get("auxiliary_loss", False))
    return DETRConfig(
        backbone=backbone, d_model=meta["d_model"],
        encoder_layers=meta["encoder_layers"], decoder_layers=meta["decoder_layers"],
        encoder_heads=meta["encoder_attention_heads"], decoder_heads=meta["decoder_attention_heads"],
        encoder_d_ff=meta["encoder_ffn_dim"], decoder_d_ff=meta["decoder_ffn_dim"],
        activation=ACTIVATIONS[act], dropout=float(meta.get("dropout", 0.1)),
        attn_dropout=float(meta.get("attention_dropout", 0.0)), norm_eps=1e-5,
        num_queries=meta["num_queries"], num_labels=num_labels, box_layers=3,
        aux_loss=aux, renorm_intermediate=aux, frozen_bn=True,
        loss=SetLossWeights(**{ours: float(meta.get(hf, getattr(SetLossWeights, ours)))
                               for hf, ours in LOSS_FIELDS.items()}),
    )


def _module(hf: str, ours: str) -> dict[str, str]:
    """A Linear / LayerNorm (weight, bias), or an attention (its q, k, v and output projections)."""
    if hf.endswith("attn"):
        return {f"{hf}.{a}_proj.{w}": f"{ours}.{a}_proj.{w}" for a in "qkv" for w in ("weight", "bias")} | \
            {f"{hf}.out_proj.{w}": f"{ours}.out_proj.{w}" for w in ("weight", "bias")}
    return {f"{hf}.{w}": f"{ours}.{w}" for w in ("weight", "bias")}


def detr_key_map(model: DETR) -> dict[str, str]:
    """The saved HF keys -> ours (the backbone's from interop/resnet.py, less the batch counters frozen
    BatchNorm does not keep)."""
    m = {BACKBONE + hf: f"backbone.{ours}" for hf, ours in resnet_key_map(model.backbone).items()
         if not hf.endswith("num_batches_tracked")}
    m["model.query_position_embeddings.weight"] = "query_embed.weight"
    for hf, ours in HEADS.items():
        m.update(_module(hf, ours))
    for stack, n, layer in (("encoder", len(model.encoder), ENCODER_LAYER),
                            ("decoder", len(model.decoder), DECODER_LAYER)):
        for i in range(n):
            for hf, ours in layer.items():
                m.update(_module(f"model.{stack}.layers.{i}.{hf}", f"{stack}.{i}.{ours}"))
    for i in range(len(model.box_head.layers)):
        m.update(_module(f"bbox_predictor.layers.{i}", f"box_head.layers.{i}"))
    return m


def in_memory_name(key: str) -> str:
    """A saved key under the names transformers 5 gives the modules in memory (what a folder written
    from a state_dict holds)."""
    key = key.replace("backbone.conv_encoder.", "backbone.").replace(".out_proj.", ".o_proj.")
    return re.sub(r"layers\.(\d+)\.fc([12])\.", r"layers.\1.mlp.fc\2.", key)


def load_detr(folder: Path, meta: dict[str, Any]) -> DETR:
    sd = HFTensors(folder)
    require(not any(k.startswith("detr.") for k in sd),
            f"{folder}: a DetrForSegmentation folder (mask head) is not supported; qkv loads "
            "DetrForObjectDetection folders")
    require("class_labels_classifier.weight" in sd,
            f"{folder}: a DETR folder without detection heads (DetrModel) is not supported; qkv loads "
            "DetrForObjectDetection folders")
    layers = "model.{}.layers.{{}}.self_attn.q_proj.weight"
    check_sizes(sd, sd.source, [
        ("encoder_layers", meta.get("encoder_layers"), layers.format("encoder"), None),
        ("decoder_layers", meta.get("decoder_layers"), layers.format("decoder"), None),
        ("d_model", meta.get("d_model"), "model.query_position_embeddings.weight", 1),
        ("num_queries", meta.get("num_queries"), "model.query_position_embeddings.weight", 0)])
    cfg = detr_config_from_hf(meta, num_labels=sd.meta("class_labels_classifier.weight").shape[0] - 1)
    model = build_skeleton(lambda: DETR(cfg))
    saved = detr_key_map(model)
    mapping = {(hf if hf in sd or in_memory_name(hf) not in sd else in_memory_name(hf)): ours
               for hf, ours in saved.items()}
    # transformers builds (and saves) every stage of the backbone, also those after the one DETR reads
    later = re.compile(r"model\.backbone\.(conv_encoder\.)?model\.encoder\.stages\.(\d+)\.")
    unused = [k for k in sd if (m := later.match(k)) and int(m.group(2)) >= len(cfg.backbone.depths)]
    load_hf_weights(model, sd, mapping, ignore=unused, source=sd.source)
    return model.eval()


register(ModelType("detr", "detection", "detr", load_detr))

__all__ = ["detr_config_from_hf", "detr_key_map", "load_detr"]
