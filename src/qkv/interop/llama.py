"""Llama-style decoders (Hugging Face model_type llama, qwen2, qwen3, mistral) <-> qkv GPT.

Why the GPT family and not a family of their own: every difference between GPT-2 and these models is
already a constructor keyword of the shared blocks, so a Llama is a GPTConfig with
  norm=rmsnorm (rms_norm_eps), ffn=swiglu (gate/up/down), position=rope (rope_theta, rope_scaling),
  n_kv_heads (GQA/MQA), bias=False, head_dim (when n_heads * head_dim != hidden_size), tie_embeddings,
  qkv_bias (Qwen2), qk_norm (Qwen3), sliding_window (Mistral; longer sequences refused).
A second model class would copy GPT.forward and the decoder protocol for nothing; presets name the shapes.

The key map differs from HF's layout in one place: q_proj, k_proj and v_proj are stacked (in that order) into
our fused qkv_proj, whose rows split as [n_heads * hd, n_kv * hd, n_kv * hd].

Loading keeps the folder's dtype (fp32, bf16, fp16) and holds one copy of the weights: the model is built with
its parameters on the meta device (common.build_skeleton), given uninitialised storage in that dtype, and
filled tensor by tensor from the safetensors files, each file opened only while its tensors are copied
(benchmarks/llm.py measures the peak).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from qkv.interop.common import (
    HFTensors,
    build_skeleton,
    check_sizes,
    expand,
    export_state,
    materialise,
    require,
    unlike,
    write_hf_folder,
)
from qkv.interop.registry import ExportRequest, ModelType, register
from qkv.models.gpt import GPT, GPTConfig
from qkv.nn.position import ROPE_SCALINGS, build_position
from qkv.storage import CheckpointError, unwrap

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# the config.json fields a decoder's KV cache is sized from (qkv info), here and in interop/moe.py
SIZING_FIELDS = ("num_hidden_layers", "num_attention_heads", "hidden_size", "max_position_embeddings")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}

# HF -> ours; "{}" = layer index. q/k/v map to one key: concatenated in this order (common.py).
KEY_MAP = {
    "model.embed_tokens.weight": "tok_emb.weight",
    "model.layers.{}.input_layernorm.weight": "decoder.blocks.{}.norm1.weight",
    "model.layers.{}.self_attn.q_proj.weight": "decoder.blocks.{}.attn.qkv_proj.weight",
    "model.layers.{}.self_attn.k_proj.weight": "decoder.blocks.{}.attn.qkv_proj.weight",
    "model.layers.{}.self_attn.v_proj.weight": "decoder.blocks.{}.attn.qkv_proj.weight",
    "model.layers.{}.self_attn.o_proj.weight": "decoder.blocks.{}.attn.out_proj.weight",
    "model.layers.{}.post_attention_layernorm.weight": "decoder.blocks.{}.norm2.weight",
    "model.layers.{}.mlp.gate_proj.weight": "decoder.blocks.{}.ffn.gate.weight",
    "model.layers.{}.mlp.up_proj.weight": "decoder.blocks.{}.ffn.up.weight",
    "model.layers.{}.mlp.down_proj.weight": "decoder.blocks.{}.ffn.down.weight",
    "model.norm.weight": "decoder.final_norm.weight",
}
QKV_BIAS = {
    f"model.layers.{{}}.self_attn.{p}_proj.bias": "decoder.blocks.{}.attn.qkv_proj.bias" for p in "qkv"
}
OUT_BIAS = {"model.layers.{}.self_attn.o_proj.bias": "decoder.blocks.{}.attn.out_proj.bias"}
MLP_BIAS = {f"model.layers.{{}}.mlp.{p}_proj.bias": f"decoder.blocks.{{}}.ffn.{q}.bias"
            for p, q in (("gate", "gate"), ("up", "up"), ("down", "down"))}
QK_NORM = {"model.layers.{}.self_attn.q_norm.weight": "decoder.blocks.{}.attn.q_norm.weight",
           "model.layers.{}.self_attn.k_norm.weight": "decoder.blocks.{}.attn.k_norm.weight"}
UNTIED_HEAD = {"lm_head.weight": "lm_head.weight"}
IGNORE = ("model.layers.{}.self_attn.rotary_emb.inv_freq", "model.rotary_emb.inv_freq")  # older checkpoints

_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_OPTIONAL_KEYS = {
    "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")
}


def _rope(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either layout: transformers 5's `rope_parameters` {"rope_type",
    "rope_theta", ...} or the older top-level `rope_theta` + `rope_scaling` {"type"|"rope_type", ...}."""
    params = dict(hf.get("rope_parameters") or {})
    require(all(not isinstance(v, Mapping) for v in params.values()),
            "per-layer-type rope_parameters are not supported")
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = dict(hf.get("rope_scaling") or params)
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    require(float(scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) == 1.0,
            "partial_rotary_factor != 1 (RoPE on part of each head) is not supported")
    if kind == "default":
        return theta, None
    require(kind in ROPE_SCALINGS, f"rope scaling type {kind!r} is not supported; supported: "
                                   f"{['none', *ROPE_SCALINGS]}")
    need = _SCALING_KEYS[kind]
    missing = [k for k in need if k not in scaling]
    require(not missing, f"rope scaling {kind!r} lacks {missing}")
    optional = {k: scaling[k] for k in _OPTIONAL_KEYS.get(kind, ()) if scaling.get(k) is not None}
    return theta, {"rope_type": kind, **{k: scaling[k] for k in need}, **optional}


def config_from_hf(hf: Mapping[str, Any]) -> GPTConfig:
    """A llama / qwen2 / qwen3 / mistral config.json -> GPTConfig; what we cannot represent is refused."""
    mt = hf.get("model_type")
    require(mt in MODEL_TYPES, f"model_type {mt!r} is not a Llama-style decoder ({MODEL_TYPES})")
    act = hf.get("hidden_act", "silu")
    require(act == "silu", f"{mt}: hidden_act {act!r} is not supported (SwiGLU uses silu)")
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or d // heads
    theta, scaling = _rope(hf)
    attention_bias = bool(hf.get("attention_bias", False))
    mlp_bias = bool(hf.get("mlp_bias", False))
    require(attention_bias == mlp_bias or not attention_bias,
            f"{mt}: attention_bias without mlp_bias (biases on q/k/v/o but not the MLP) is not supported")
    window = None
    if mt == "mistral":
        window = hf.get("sliding_window")
    elif hf.get("use_sliding_window", False) or "sliding_attention" in (hf.get("layer_types") or ()):
        raise CheckpointError(
            f"{mt}: sliding-window layers (use_sliding_window / layer_types) are not supported"
        )
    # kept even when it is as long as the context: RoPE runs past the context, and there the window limits
    # attention
    context = int(hf.get("max_position_embeddings", 2048))
    return GPTConfig(
        vocab_size=int(hf["vocab_size"]),
        n_layers=int(hf["num_hidden_layers"]),
        d_model=d,
        n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=None if head_dim * heads == d else int(head_dim),
        d_ff=int(hf["intermediate_size"]),
        ffn="swiglu",
        norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        placement="pre",
        position="rope",
        rope_base=theta,
        rope_scaling=scaling,
        context_length=context,
        attention="fused",
        bias=attention_bias and mlp_bias,
        qkv_bias=True if mt == "qwen2" else None,
        qk_norm=mt == "qwen3",
        sliding_window=None if window is None else int(window),
        dropout=0.0,
        attn_dropout=float(hf.get("attention_dropout", 0.0)),
        init_std=float(hf.get("initializer_range", 0.02)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def key_map(config: GPTConfig) -> dict[str, str]:
    """The concrete HF -> ours map of a config (its layers, biases, norms, head)."""
    m = dict(KEY_MAP)
    if config.bias:
        m.update(QKV_BIAS, **OUT_BIAS, **MLP_BIAS)
    elif config.qkv_bias:
        m.update(QKV_BIAS)
    if config.qk_norm:
        m.update(QK_NORM)
    if not config.tie_embeddings:
        m.update(UNTIED_HEAD)
    return expand(m, config.n_layers)


def empty_model(config: GPTConfig, dtype: torch.dtype) -> GPT:
    """A GPT whose weights are uninitialised storage in `dtype` (the package's one way: build_skeleton, so the
    tied head stays tied and nothing is initialised or copied twice)."""
    # built for at most 4096 positions, then given the real config: RoPE's table grows on demand, and a
    # long-context model's whole table would cost time and memory for nothing (1.6 s, 192 MB at 128k)
    start = dataclasses.replace(config, context_length=min(config.context_length, 4096))
    model = build_skeleton(lambda: GPT(start))
    model.config = config
    materialise(model, dtype)
    # the RoPE tables stay float32 (materialise cast them with the weights; rotate casts them per call)
    model.decoder.position = build_position(
        "rope", d_model=config.d_model, n_heads=config.n_heads, max_len=min(config.context_length, 4096),
        rope_base=config.rope_base, rope_scaling=config.rope_scaling, head_dim=config.head_dim)
    return model


def fill_model(model: GPT, tensors: HFTensors, mapping: Mapping[str, str]) -> None:
    """Copy the folder's tensors into `model` through `mapping`, one parameter at a time, checking names
    (missing / unexpected) and shapes, and that every parameter is filled."""
    names = set(tensors)
    source = tensors.source
    missing = [k for k in mapping if k not in names]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: missing key {missing[0]!r}{more}")
    ignored = [re.compile("^" + re.escape(t).replace(re.escape("{}"), r"\d+") + "$") for t in IGNORE]
    if "lm_head.weight" not in mapping:
        ignored.append(re.compile("^lm_head\\.weight$"))  # a tied head stored anyway (checked below)
    unexpected = sorted(k for k in names - set(mapping) if not any(p.match(k) for p in ignored))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more: {unexpected[1:4]})" if len(unexpected) > 1 else ""
        raise CheckpointError(f"{source}: unexpected key {unexpected[0]!r}{more}; this architecture variant "
                              "is not supported by the loader")
    groups: dict[str, list[str]] = {}
    for hf, ours in mapping.items():
        groups.setdefault(ours, []).append(hf)
    own = dict(model.named_parameters(remove_duplicate=False))
    unfilled = {n for n, p in model.named_parameters()}  # tied parameters appear once
    with torch.no_grad():
        for ours, hfs in groups.items():
            if ours not in own:
                raise CheckpointError(f"{source}: the model has no parameter {ours!r} (a key-map bug)")
            target = own[ours]
            pieces = [tensors[n] for n in hfs]
            rows = sum(t.shape[0] for t in pieces)
            shape = (rows, *pieces[0].shape[1:])
            if shape != tuple(target.shape) or any(t.shape[1:] != pieces[0].shape[1:] for t in pieces):
                raise CheckpointError(
                    f"{source}: {', '.join(hfs)} have shape(s) {[tuple(t.shape) for t in pieces]}"
                    f" but the config makes {ours!r} {tuple(target.shape)}"
                )
            start = 0
            for t in pieces:
                target.narrow(0, start, t.shape[0]).copy_(t)
                start += t.shape[0]
            del pieces
            for n, p in model.named_parameters():
                if p is target:
                    unfilled.discard(n)
    if unfilled:
        raise CheckpointError(
            f"{source}: nothing in the key map fills {sorted(unfilled)[:3]} (a key-map bug)"
        )
    if model.config.tie_embeddings and "lm_head.weight" in names:
        head = tensors["lm_head.weight"]
        require(torch.equal(head.to(model.tok_emb.weight.dtype), model.tok_emb.weight),
                f"{source}: lm_head.weight differs from the embedding although tie_word_embeddings is true")


def load_llama(folder: Path, hf_config: dict[str, Any]) -> GPT:
    """A LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM / MistralForCausalLM folder -> our GPT, in
    eval mode, in the dtype of the folder's embedding weights."""
    config = config_from_hf(hf_config)
    tensors = HFTensors(folder)  # names, shapes and dtypes now; each tensor read when it is copied
    check_decoder_sizes(tensors, config)  # before the key map is expanded per layer
    return load_decoder(folder, hf_config, config, key_map(config), tensors)


def check_decoder_sizes(tensors: Any, config: GPTConfig) -> None:
    """config.json's sizes against the file's headers, before anything is expanded or allocated from them."""
    require(
        "model.embed_tokens.weight" in tensors,
        f"{tensors.source}: no model.embed_tokens.weight (a base-model folder without the 'model.' prefix "
        "is not supported)",
    )
    c, layer = config, "model.layers.{}.self_attn."
    hd = c.head_dim or c.d_model // c.n_heads
    check_sizes(
        tensors,
        tensors.source,
        [
            ("num_hidden_layers", c.n_layers, "model.layers.{}.input_layernorm.weight", None),
            ("vocab_size", c.vocab_size, "model.embed_tokens.weight", 0),
            ("hidden_size", c.d_model, "model.embed_tokens.weight", 1),
            ("intermediate_size", c.d_ff, "model.layers.0.mlp.up_proj.weight", 0),
            ("num_attention_heads * head_dim", c.n_heads * hd, layer.format(0) + "q_proj.weight", 0),
            (
                "num_key_value_heads * head_dim",
                (c.n_kv_heads or c.n_heads) * hd,
                layer.format(0) + "k_proj.weight",
                0,
            ),
        ],
    )


def load_decoder(folder: Path, hf_config: dict[str, Any], config: GPTConfig, mapping: Mapping[str, str],
                 tensors: HFTensors | None = None) -> GPT:
    """A Llama-style folder whose config and key map are already made (here, and for the MoE variants in
    interop/moe.py) -> our GPT, in eval mode, in the dtype of the folder's embedding weights. tensors: the
    folder's tensors, when the caller has opened (or renamed) them."""
    if tensors is None:
        tensors = HFTensors(folder)
    check_decoder_sizes(tensors, config)
    dtype = tensors.meta("model.embed_tokens.weight").dtype
    model = empty_model(config, dtype if dtype.is_floating_point else torch.float32)
    fill_model(model, tensors, mapping)
    # the model's own token ids (generation_config.json, read by load_model, adds to and overrides them)
    ids = {
        k: hf_config[k]
        for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        if hf_config.get(k) is not None
    }
    model.folder_generation_config = ids
    return model.eval()


# -- export ------------------------------------------------------------------------------------------------
def model_type_of(config: GPTConfig) -> str:
    """The HF model_type that expresses a config: qwen3 (q/k norms), qwen2 (q/k/v biases only), mistral (a
    sliding window), else llama."""
    if config.qk_norm:
        return "qwen3"
    if config.qkv_bias and not config.bias:
        return "qwen2"
    if config.sliding_window is not None:
        return "mistral"
    return "llama"


def config_to_hf(config: GPTConfig, model_type: str | None = None) -> dict[str, Any]:
    """The inverse of config_from_hf for configs these architectures can express."""
    mt = model_type or model_type_of(config)
    require(mt in MODEL_TYPES, f"cannot export to model_type {mt!r}; choose one of {MODEL_TYPES}")
    require(
        not config.moe.n_experts,
        "a mixture-of-experts model is exported as mixtral, qwen2_moe or qwen3_moe "
        "(qkv.interop.moe.export_moe)",
    )
    off = unlike(config, position="rope", placement="pre", norm="rmsnorm", ffn="swiglu", scaled=True,
                 attention=("fused", "naive"))
    require(not off, "only Llama-shaped configs (RoPE, Pre-LN, RMSNorm, SwiGLU, scaled attention) can be "
                     f"exported to a Llama-style folder; this model has {', '.join(off)}")
    require((mt == "qwen2") == bool(config.qkv_bias and not config.bias),
            f"q/k/v-only biases are Qwen2's; model_type {mt!r} does not express qkv_bias={config.qkv_bias}")
    require(
        (mt == "qwen3") == config.qk_norm, f"q/k norms are Qwen3's; model_type {mt!r} cannot express them"
    )
    require(config.sliding_window is None or mt == "mistral", "a sliding window is exported as mistral only")
    head_dim = config.head_dim or config.d_model // config.n_heads
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_base}
    if config.rope_scaling:
        scaling = dict(config.rope_scaling)
        rope = {**{k: v for k, v in scaling.items() if k != "type"},
                "rope_type": scaling.get("rope_type", scaling.get("type")), "rope_theta": config.rope_base}
    out: dict[str, Any] = {
        "model_type": mt,
        "architectures": [ARCHITECTURES[mt]],
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff or 4 * config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads or config.n_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.context_length,
        "rms_norm_eps": config.norm_eps,
        "initializer_range": config.init_std,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": config.attn_dropout,
        # both layouts: transformers 5 reads rope_parameters, 4.x rope_theta + rope_scaling
        "rope_parameters": rope,
        "rope_theta": config.rope_base,
        "rope_scaling": None
        if not config.rope_scaling
        else {k: v for k, v in rope.items() if k != "rope_theta"},
    }
    if mt in ("llama", "qwen3"):
        out["attention_bias"] = config.bias
    if mt == "llama":
        out["mlp_bias"] = config.bias
    if mt == "mistral":
        out["sliding_window"] = config.sliding_window
    if mt in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None)
    return out


def export_llama(model: GPT, path: str | os.PathLike, *, model_type: str | None = None,
                 token_ids: Mapping[str, Any] | None = None) -> Path:
    """Write `model` as a Hugging Face folder (config.json + model.safetensors, in the model's dtype) that
    transformers loads as LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM / MistralForCausalLM.
    token_ids: bos/eos/pad ids for config.json (default: the model's generation defaults)."""
    model = unwrap(model)
    return export_decoder(
        model, path, config_to_hf(model.config, model_type), key_map(model.config), token_ids
    )


def export_decoder(model: GPT, path: str | os.PathLike, hf_config: dict[str, Any], mapping: Mapping[str, str],
                   token_ids: Mapping[str, Any] | None = None) -> Path:
    """export_llama's writer for a config.json and key map already made (here, and in interop/moe.py)."""
    config = model.config
    defaults = model.generation_defaults() if hasattr(model, "generation_defaults") else {}
    ids = dict(token_ids) if token_ids is not None else defaults
    hf_config.update({k: ids.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    hd = config.head_dim or config.d_model // config.n_heads
    q, kv = config.n_heads * hd, (config.n_kv_heads or config.n_heads) * hd
    state = model.state_dict()
    fused = {k: v for k, v in state.items() if ".attn.qkv_proj." in k}
    # q/k/v rows differ in size under GQA: split them here, the rest goes through the generic inverse map
    mapping = {hf: ours for hf, ours in mapping.items() if ours not in fused}
    out = export_state(state, mapping)
    for ours, t in fused.items():
        layer, kind = ours.split(".")[2], ours.rsplit(".", 1)[1]
        for name, piece in zip("qkv", t.detach().split([q, kv, kv], dim=0)):
            out[f"model.layers.{layer}.self_attn.{name}_proj.{kind}"] = piece.contiguous().clone()
    return write_hf_folder(path, out, hf_config)


def write_llama(model: GPT, out: Path, request: ExportRequest) -> None:
    export_llama(model, out, model_type=request.model_type)


register(*(ModelType(mt, "decoder", "gpt", load_llama, write_llama, sizing_fields=SIZING_FIELDS)
           for mt in MODEL_TYPES))

__all__ = ["KEY_MAP", "config_from_hf", "config_to_hf", "export_decoder", "export_llama", "key_map",
           "load_decoder", "load_llama", "model_type_of"]
