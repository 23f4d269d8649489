"""GPT-2 (Hugging Face `GPT2LMHeadModel` / `GPT2Model` folders) <-> qkv GPT.

HF GPT-2 is the same network as our GPT preset: learned positions, Pre-LN blocks, fused QKV, tanh-GELU,
a final LayerNorm and an LM head tied to the token embedding. Two storage differences:
  - its Linear layers are `Conv1D`, weight stored as (in, out): transposed on the way in and out;
  - `c_attn` already stacks q, k, v along its output dimension, in the order our qkv_proj splits them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from qkv.interop.common import (
    HFTensors,
    build_skeleton,
    check_sizes,
    expand,
    export_state,
    load_hf_weights,
    require,
    unlike,
    write_hf_folder,
)
from qkv.interop.registry import ExportRequest, ModelType, register
from qkv.models.gpt import GPT, GPTConfig
from qkv.storage import unwrap

# HF (after stripping the 'transformer.' prefix of GPT2LMHeadModel) -> ours; "{}" = layer index
KEY_MAP = {
    "wte.weight": "tok_emb.weight",
    "wpe.weight": "decoder.position.weight",
    "h.{}.ln_1.weight": "decoder.blocks.{}.norm1.weight",
    "h.{}.ln_1.bias": "decoder.blocks.{}.norm1.bias",
    "h.{}.attn.c_attn.weight": "decoder.blocks.{}.attn.qkv_proj.weight",
    "h.{}.attn.c_attn.bias": "decoder.blocks.{}.attn.qkv_proj.bias",
    "h.{}.attn.c_proj.weight": "decoder.blocks.{}.attn.out_proj.weight",
    "h.{}.attn.c_proj.bias": "decoder.blocks.{}.attn.out_proj.bias",
    "h.{}.ln_2.weight": "decoder.blocks.{}.norm2.weight",
    "h.{}.ln_2.bias": "decoder.blocks.{}.norm2.bias",
    "h.{}.mlp.c_fc.weight": "decoder.blocks.{}.ffn.up.weight",
    "h.{}.mlp.c_fc.bias": "decoder.blocks.{}.ffn.up.bias",
    "h.{}.mlp.c_proj.weight": "decoder.blocks.{}.ffn.down.weight",
    "h.{}.mlp.c_proj.bias": "decoder.blocks.{}.ffn.down.bias",
    "ln_f.weight": "decoder.final_norm.weight",
    "ln_f.bias": "decoder.final_norm.bias",
}
UNTIED_HEAD = {"lm_head.weight": "lm_head.weight"}

# Conv1D weights are (in, out); nn.Linear's are (out, in). Transposing is its own inverse.
CONV1D = (
    "h.{}.attn.c_attn.weight",
    "h.{}.attn.c_proj.weight",
    "h.{}.mlp.c_fc.weight",
    "h.{}.mlp.c_proj.weight",
)
# a view: load_hf_weights copies it into place and export_state makes its own contiguous copy
TRANSFORMS = {k: (lambda t: t.t()) for k in CONV1D}

# Tensors older checkpoints carry that hold no weights: the causal-mask buffers of GPT2Attention.
IGNORE = ("h.{}.attn.bias", "h.{}.attn.masked_bias")

# config.json's, kept on load and written on export
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")

# HF activation_function -> our ffn name. gelu_new / gelu_pytorch_tanh are the tanh approximation.
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
               "gelu": "gelu", "relu": "relu"}


def config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    """Map a GPT-2 config.json to GPTConfig; refuse the options our GPT does not implement."""
    act = hf.get("activation_function", "gelu_new")
    require(act in ACTIVATIONS, f"GPT-2 activation_function {act!r} is not supported; "
                                f"supported: {sorted(ACTIVATIONS)}")
    require(not hf.get("add_cross_attention", False), "GPT-2 with add_cross_attention=True is not supported")
    require(not hf.get("scale_attn_by_inverse_layer_idx", False),
            "GPT-2 with scale_attn_by_inverse_layer_idx=True is not supported")
    d = int(hf.get("n_embd", 768))  # as llama reads hidden_size: a bad value is the loader's CheckpointError
    return GPTConfig(
        vocab_size=hf.get("vocab_size", 50257),
        n_layers=hf.get("n_layer", 12),
        d_model=d,
        n_heads=hf.get("n_head", 12),
        context_length=hf.get("n_positions", 1024),
        d_ff=hf.get("n_inner") or 4 * d,
        ffn=ACTIVATIONS[act],
        norm="layernorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        placement="pre",
        position="learned",
        attention="fused",
        scaled=bool(hf.get("scale_attn_weights", True)),
        bias=True,
        dropout=float(hf.get("resid_pdrop", 0.1)),
        attn_dropout=float(hf.get("attn_pdrop", 0.1)),
        init_std=float(hf.get("initializer_range", 0.02)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def load_gpt2(folder: Path, hf_config: dict[str, Any]) -> GPT:
    """A GPT2LMHeadModel or GPT2Model folder -> our GPT (eval mode; a bf16 or fp16 file keeps its dtype)."""
    config = config_from_hf(hf_config)
    hf_state = HFTensors(folder)  # names, shapes and dtypes now; each tensor read when it is copied
    hf_state.rename(lambda k: k.removeprefix("transformer."))
    c = config
    check_sizes(hf_state, hf_state.source, [
        ("n_layer", c.n_layers, "h.{}.ln_1.weight", None), ("vocab_size", c.vocab_size, "wte.weight", 0),
        ("n_embd", c.d_model, "wte.weight", 1), ("n_positions", c.context_length, "wpe.weight", 0),
        ("n_inner", c.d_ff, "h.0.mlp.c_fc.weight", 1)])  # Conv1D: (in, out)
    mapping = expand(KEY_MAP, config.n_layers)
    ignore, tied = IGNORE, {}
    if config.tie_embeddings:
        # a tied head is usually omitted by HF; when a file stores it, it must equal the embedding
        ignore = (*IGNORE, "lm_head.weight")
        tied = {"lm_head.weight": ("wte.weight", f"{hf_state.source}: lm_head.weight differs from wte.weight "
                                                 "although tie_word_embeddings is true")}
    else:
        mapping.update(UNTIED_HEAD)
    model = build_skeleton(lambda: GPT(config))  # parameters on meta: storage comes in the file's dtype
    load_hf_weights(model, hf_state, mapping, transforms=TRANSFORMS, ignore=ignore, source=hf_state.source,
                    tied=tied)
    # config.json's token ids, as transformers reads them (generation_config.json, read by load_model,
    # overrides)
    model.folder_generation_config = {k: hf_config[k] for k in TOKEN_IDS if hf_config.get(k) is not None}
    return model.eval()


def config_to_hf(config: GPTConfig) -> dict[str, Any]:
    """The inverse of config_from_hf, for configs a GPT2LMHeadModel can express."""
    act = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
    off = unlike(config, position="learned", placement="pre", norm="layernorm", bias=True,
                 qkv_bias=(None, True), n_kv_heads=(None, config.n_heads),
                 head_dim=(None, config.d_model // config.n_heads), qk_norm=False, sliding_window=None,
                 ffn=tuple(act))
    if config.moe.n_experts:
        off.append(f"moe.n_experts={config.moe.n_experts}")
    if config.mla.enabled:
        off.append(f"mla.kv_lora_rank={config.mla.kv_lora_rank}")
    require(not off, "only GPT-2-shaped configs (learned positions, Pre-LN, LayerNorm, biases, MHA, "
                     "gelu/gelu_tanh/relu FFN) can be exported to a GPT-2 folder; this model has "
                     + ", ".join(off))
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": config.vocab_size,
        "n_layer": config.n_layers,
        "n_embd": config.d_model,
        "n_head": config.n_heads,
        "n_positions": config.context_length,
        "n_inner": None if config.d_ff in (None, 4 * config.d_model) else config.d_ff,
        "activation_function": act[config.ffn],
        "layer_norm_epsilon": config.norm_eps,
        "scale_attn_weights": config.scaled,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.attn_dropout,
        "initializer_range": config.init_std,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": config.vocab_size - 1,
        "eos_token_id": config.vocab_size
        - 1,  # GPT-2's <|endoftext|>, unless the model has its own (export_gpt2)
    }


def export_gpt2(model: GPT, path: str | os.PathLike) -> Path:
    """Write `model` as a Hugging Face GPT2LMHeadModel folder (config.json + model.safetensors)."""
    model = unwrap(model)
    hf_config = config_to_hf(model.config)
    own = model.generation_defaults() if hasattr(model, "generation_defaults") else {}
    hf_config.update({k: own[k] for k in TOKEN_IDS if own.get(k) is not None})
    mapping = expand(KEY_MAP, model.config.n_layers)
    if not model.config.tie_embeddings:
        mapping.update(UNTIED_HEAD)
    state = export_state(model.state_dict(), mapping, transforms=TRANSFORMS)
    state = {("transformer." + k if not k.startswith("lm_head.") else k): v for k, v in state.items()}
    return write_hf_folder(path, state, hf_config)


def write_gpt2(model: GPT, out: Path, request: ExportRequest) -> None:
    export_gpt2(model, out)


register(ModelType("gpt2", "decoder", "gpt", load_gpt2, write_gpt2,
                   sizing_fields=("n_layer", "n_head", "n_embd", "n_positions")))

__all__ = ["KEY_MAP", "config_from_hf", "config_to_hf", "export_gpt2", "load_gpt2"]
