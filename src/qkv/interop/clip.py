"""Hugging Face `clip` folders (CLIPModel: a ViT image tower, a causal text tower, two projections and a
learned temperature) -> qkv's CLIP (models/clip.py), by an explicit key map.

HF CLIP's towers are Pre-LN with separate q/k/v linears (ours fuse them: rows q, then k, then v), quick-GELU,
LayerNorm eps 1e-5. The image tower adds a class token and learned positions to bias-free patches, normalises
the sum (`pre_layrnorm`: our ViT's embed_norm), and pools the class token through `post_layernorm` (our ViT's
final norm, applied to every token; the class token's row is the same). The text tower pools the first
end-of-text token (`eos_token_id`), or the largest id when eos_token_id is 2 (folders written before
transformers fixed the field). Image preprocessing is CLIPImageProcessor's (interop/llava.ImageProcessor).

Hugging Face `siglip` folders (SiglipModel) are the same towers with other ends: no class token, a biased
patch convolution, no norm before the blocks; `post_layernorm` on every patch, then a multihead attention
pooling head (`head`: a probe, torch's MultiheadAttention, a LayerNorm and an MLP; our ViT's pooling "map")
whose output is the image embedding (no visual projection). The text tower is bidirectional and pooled at the
final position (texts are padded to max_position_embeddings), through a biased `head`; scoring is a sigmoid
with a learned `logit_bias`, and exp(logit_scale) is not capped.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from torch import Tensor

from qkv.interop.common import HFTensors, build_skeleton, check_sizes, load_hf_weights, require
from qkv.interop.registry import ModelType, register
from qkv.interop.vit import hf_activation
from qkv.models.clip import CLIP, CLIPConfig
from qkv.models.vit import ViTConfig

# transformers' CLIPTextConfig / CLIPVisionConfig defaults, for the fields a folder's config.json leaves out
TEXT_DEFAULTS = {"vocab_size": 49408, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12,
                 "num_attention_heads": 8, "max_position_embeddings": 77, "hidden_act": "quick_gelu",
                 "layer_norm_eps": 1e-5, "eos_token_id": 49407}
VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                   "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 32,
                   "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}


def _sub(meta: dict[str, Any], name: str, defaults: dict[str, Any]) -> dict[str, Any]:
    sub = meta.get(name) or {}
    require(isinstance(sub, dict), f"config.json: {name} must be a mapping, got {type(sub).__name__}")
    return {**defaults, **{k: v for k, v in sub.items() if v is not None}}


def _act(name: str) -> str:
    return "quick_gelu" if name == "quick_gelu" else hf_activation(name)


def config_from_hf(meta: dict[str, Any]) -> CLIPConfig:
    t, v = _sub(meta, "text_config", TEXT_DEFAULTS), _sub(meta, "vision_config", VISION_DEFAULTS)
    eos = t["eos_token_id"]
    require(isinstance(eos, int) and not isinstance(eos, bool),
            f"config.json: text_config.eos_token_id must be one integer, got {eos!r}")
    vision = ViTConfig(
        image_size=int(v["image_size"]), patch_size=int(v["patch_size"]), n_channels=int(v["num_channels"]),
        n_layers=int(v["num_hidden_layers"]), d_model=int(v["hidden_size"]),
        n_heads=int(v["num_attention_heads"]), d_ff=int(v["intermediate_size"]), ffn=_act(v["hidden_act"]),
        norm_eps=float(v["layer_norm_eps"]), pooling="cls", patch_position="learned", head="none",
        placement="pre", embed_norm=True, patch_bias=False)
    return CLIPConfig(
        vocab_size=int(t["vocab_size"]), n_layers=int(t["num_hidden_layers"]), d_model=int(t["hidden_size"]),
        n_heads=int(t["num_attention_heads"]), d_ff=int(t["intermediate_size"]), ffn=_act(t["hidden_act"]),
        norm_eps=float(t["layer_norm_eps"]), context_length=int(t["max_position_embeddings"]),
        embed_dim=int(meta.get("projection_dim", 512)), text_causal=True,
        text_pool="argmax" if eos == 2 else "eos", text_eos_id=eos,
        logit_scale_init=float(meta.get("logit_scale_init_value", 2.6592)), vision=vision)


SIGLIP_TEXT_DEFAULTS = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 3072,
                        "num_hidden_layers": 12, "num_attention_heads": 12, "max_position_embeddings": 64,
                        "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "projection_size": None}
SIGLIP_VISION_DEFAULTS = {**VISION_DEFAULTS, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                          "layer_norm_eps": 1e-6, "vision_use_head": True}


def siglip_config_from_hf(meta: dict[str, Any]) -> CLIPConfig:
    t = _sub(meta, "text_config", SIGLIP_TEXT_DEFAULTS)
    v = _sub(meta, "vision_config", SIGLIP_VISION_DEFAULTS)
    require(v["vision_use_head"] is True, "config.json: vision_config.vision_use_head is false (a "
            "SiglipModel without the pooling head has no image embedding)")
    vision = ViTConfig(
        image_size=int(v["image_size"]), patch_size=int(v["patch_size"]), n_channels=int(v["num_channels"]),
        n_layers=int(v["num_hidden_layers"]), d_model=int(v["hidden_size"]),
        n_heads=int(v["num_attention_heads"]), d_ff=int(v["intermediate_size"]), ffn=_act(v["hidden_act"]),
        norm_eps=float(v["layer_norm_eps"]), pooling="map", patch_position="learned", head="none",
        placement="pre")
    return CLIPConfig(
        vocab_size=int(t["vocab_size"]), n_layers=int(t["num_hidden_layers"]), d_model=int(t["hidden_size"]),
        n_heads=int(t["num_attention_heads"]), d_ff=int(t["intermediate_size"]), ffn=_act(t["hidden_act"]),
        norm_eps=float(t["layer_norm_eps"]), context_length=int(t["max_position_embeddings"]),
        embed_dim=int(t["projection_size"] or t["hidden_size"]), text_causal=False, text_pool="final",
        visual_projection=False, text_proj_bias=True, max_logit_scale=None, logit_scale_init=math.log(10),
        logit_bias_init=-10.0, vision=vision)


def encoder_layer_map(hf: str, ours: str, n_layers: int) -> dict[str, str]:
    """The layers of a CLIP / SigLIP tower (CLIP's and SigLIP's two, LLaVA's and SmolVLM's vision towers):
    `{hf}encoder.layers.i.*` -> `{ours}blocks.i.*`; q, k and v fuse into qkv_proj, concatenated in that
    order."""
    simple = {"self_attn.out_proj": "attn.out_proj", "layer_norm1": "norm1", "layer_norm2": "norm2",
              "mlp.fc1": "ffn.up", "mlp.fc2": "ffn.down"}
    m: dict[str, str] = {}
    for i in range(n_layers):
        h, o = f"{hf}encoder.layers.{i}.", f"{ours}blocks.{i}."
        for kind in ("weight", "bias"):
            m.update({f"{h}self_attn.{p}_proj.{kind}": f"{o}attn.qkv_proj.{kind}" for p in "qkv"})
            m.update({f"{h}{a}.{kind}": f"{o}{b}.{kind}" for a, b in simple.items()})
    return m


def key_map(config: CLIPConfig) -> dict[str, str]:
    """HF CLIPModel keys -> ours."""
    v, t = "vision_model.", "text_model."
    m = {f"{v}embeddings.class_embedding": "visual.cls_emb",
         f"{v}embeddings.patch_embedding.weight": "visual.patch_emb.proj.weight",
         f"{v}embeddings.position_embedding.weight": "visual.encoder.position.weight",
         f"{t}embeddings.token_embedding.weight": "tok_emb.weight",
         f"{t}embeddings.position_embedding.weight": "text.position.weight",
         "visual_projection.weight": "visual_proj.weight", "text_projection.weight": "text_proj.weight",
         "logit_scale": "logit_scale"}
    for kind in ("weight", "bias"):
        m[f"{v}pre_layrnorm.{kind}"] = f"visual.encoder.embed_norm.{kind}"
        m[f"{v}post_layernorm.{kind}"] = f"visual.encoder.final_norm.{kind}"
        m[f"{t}final_layer_norm.{kind}"] = f"text.final_norm.{kind}"
    m.update(encoder_layer_map(f"{v}", "visual.encoder.", config.vision.n_layers))
    m.update(encoder_layer_map(f"{t}", "text.", config.n_layers))
    return m


def siglip_key_map(config: CLIPConfig) -> dict[str, str]:
    """HF SiglipModel keys -> ours."""
    v, t, h = "vision_model.", "text_model.", "vision_model.head."
    m = {f"{v}embeddings.position_embedding.weight": "visual.encoder.position.weight",
         f"{t}embeddings.token_embedding.weight": "tok_emb.weight",
         f"{t}embeddings.position_embedding.weight": "text.position.weight",
         f"{h}probe": "visual.map_head.probe",
         "logit_scale": "logit_scale", "logit_bias": "logit_bias"}
    for kind in ("weight", "bias"):
        m[f"{v}embeddings.patch_embedding.{kind}"] = f"visual.patch_emb.proj.{kind}"
        m[f"{v}post_layernorm.{kind}"] = f"visual.encoder.final_norm.{kind}"
        m[f"{h}attention.in_proj_{kind}"] = f"visual.map_head.attention.in_proj_{kind}"
        m[f"{h}attention.out_proj.{kind}"] = f"visual.map_head.attention.out_proj.{kind}"
        m[f"{h}layernorm.{kind}"] = f"visual.map_head.norm.{kind}"
        m[f"{h}mlp.fc1.{kind}"] = f"visual.map_head.ffn.up.{kind}"
        m[f"{h}mlp.fc2.{kind}"] = f"visual.map_head.ffn.down.{kind}"
        m[f"{t}final_layer_norm.{kind}"] = f"text.final_norm.{kind}"
        m[f"{t}head.{kind}"] = f"text_proj.{kind}"
    m.update(encoder_layer_map(f"{v}", "visual.encoder.", config.vision.n_layers))
    m.update(encoder_layer_map(f"{t}", "text.", config.n_layers))
    return m


def _check_sizes(sd: HFTensors, config: CLIPConfig, *, class_token: bool, vision_ff: str,
                 projection: tuple[str, str]) -> None:
    """config.json's sizes against the weights' shapes, for both towers (CLIP's and SigLIP's layouts differ in
    the class token, where the vision MLP is read, and the projection: (its config name, its weight))."""
    v, e, t = config.vision, "vision_model.embeddings.", "text_model."
    check_sizes(sd, sd.source, [
        ("vision_config.num_hidden_layers", v.n_layers, "vision_model.encoder.layers.{}.layer_norm1.weight",
         None),
        ("vision_config.hidden_size", v.d_model, f"{e}patch_embedding.weight", 0),
        ("vision_config.num_channels", v.n_channels, f"{e}patch_embedding.weight", 1),
        ("vision_config.patch_size", v.patch_size, f"{e}patch_embedding.weight", 2),
        ("(image_size / patch_size)**2" + (" + 1" if class_token else ""), v.grid ** 2 + class_token,
         f"{e}position_embedding.weight", 0),
        ("vision_config.intermediate_size", v.d_ff, vision_ff, 0),
        ("text_config.num_hidden_layers", config.n_layers, t + "encoder.layers.{}.layer_norm1.weight", None),
        ("text_config.vocab_size", config.vocab_size, f"{t}embeddings.token_embedding.weight", 0),
        ("text_config.hidden_size", config.d_model, f"{t}embeddings.token_embedding.weight", 1),
        ("text_config.max_position_embeddings", config.context_length,
         f"{t}embeddings.position_embedding.weight", 0),
        ("text_config.intermediate_size", config.d_ff, f"{t}encoder.layers.0.mlp.fc1.weight", 0),
        (projection[0], config.embed_dim, projection[1], 0)])


def load_clip(folder: Path, meta: dict[str, Any]) -> CLIP:
    """A CLIPModel folder -> our CLIP in eval mode, in the folder's dtype."""
    sd = HFTensors(folder)
    for k in [k for k in sd if k.endswith("position_ids")]:  # buffers of older saves: computed, not weights
        del sd[k]
    require("text_projection.weight" in sd and "visual_projection.weight" in sd,
            f"{sd.source}: no text_projection / visual_projection (a CLIPModel folder holds both towers; "
            "a lone CLIPVisionModel or CLIPTextModel is not supported)")
    config = config_from_hf(meta)
    _check_sizes(sd, config, class_token=True, vision_ff="vision_model.encoder.layers.0.mlp.fc1.weight",
                 projection=("projection_dim", "text_projection.weight"))
    model = build_skeleton(lambda: CLIP(config))
    transforms = {"vision_model.embeddings.class_embedding": lambda x: x.reshape(1, 1, -1),
                  "vision_model.embeddings.position_embedding.weight": lambda x: x.unsqueeze(0)}
    load_hf_weights(model, sd, key_map(config), transforms=transforms, source=sd.source)
    return model.eval()


def _scalar(x: Tensor) -> Tensor:
    return x.reshape(())  # SiglipModel keeps logit_scale and logit_bias as (1,) tensors


def load_siglip(folder: Path, meta: dict[str, Any]) -> CLIP:
    """A SiglipModel folder -> our CLIP (SigLIP's ends: CLIPConfig.sigmoid) in eval mode."""
    sd = HFTensors(folder)
    require("logit_bias" in sd and "text_model.head.weight" in sd,
            f"{sd.source}: no logit_bias / text_model.head (a SiglipModel folder holds both towers; a lone "
            "SiglipVisionModel or SiglipTextModel is not supported)")
    config = siglip_config_from_hf(meta)
    _check_sizes(sd, config, class_token=False, vision_ff="vision_model.head.mlp.fc1.weight",
                 projection=("text_config.projection_size", "text_model.head.weight"))
    model = build_skeleton(lambda: CLIP(config))
    transforms = {"logit_scale": _scalar, "logit_bias": _scalar,
                  "vision_model.embeddings.position_embedding.weight": lambda x: x.unsqueeze(0)}
    load_hf_weights(model, sd, siglip_key_map(config), transforms=transforms, source=sd.source)
    return model.eval()


register(ModelType("clip", "dual", "clip", load_clip))
register(ModelType("siglip", "dual", "clip", load_siglip))
