"""DeepSeek-V3 (Hugging Face model_type deepseek_v3) <-> qkv GPT with multi-head latent attention and experts.

A DeepSeek-V3 decoder is a Llama-shaped Pre-LN RMSNorm / SwiGLU stack whose attention is MLA (nn/mla.py) and
whose feed-forward is, after the first `first_k_dense_replace` dense layers, a mixture of experts (nn/moe.py)
with sigmoid scores, group-limited routing (n_group, topk_group), the selection bias e_score_correction_bias,
renormalised top-k weights (norm_topk_prob) times routed_scaling_factor, and shared experts. Every one of
these is already a field of GPTConfig (mla, moe), so the loader is a config translation and a key map:

  self_attn.q_proj | q_a_proj, q_a_layernorm, q_b_proj  -> attn.q_proj | q_a_proj, q_a_norm, q_b_proj
  self_attn.kv_a_proj_with_mqa, kv_a_layernorm          -> attn.kv_a_proj, attn.kv_a_norm
  self_attn.kv_b_proj, o_proj                           -> attn.kv_b_proj, attn.out_proj
  mlp.gate.weight, mlp.gate.e_score_correction_bias     -> ffn.router.weight, ffn.router.score_bias (a buffer)
  mlp.experts.e.{gate,up,down}_proj, mlp.shared_experts -> ffn.experts.e.{gate,up,down}, ffn.shared

Rotary layout: with rope_interleave (the default, and DeepSeek's checkpoints) the rotated dimensions form
adjacent pairs (x0, x1), (x2, x3), ...; qkv's RoPE pairs the two halves. The loader reorders the rotary rows
of the query and kv_a projections (evens, then odds), which gives the same scores: transformers' interleaved
rotation returns exactly that order. Export writes the half-split layout with rope_interleave false, which
transformers reads too.

YaRN rope scaling (DeepSeek-V3's long-context setting) is RoPE's yarn rule (nn/position.py) plus, from
mscale_all_dim, the softmax scale times yarn_mscale(factor, mscale_all_dim)^2, as transformers applies it.

Not supported (each refused with a one-line error): deepseek_v2 (another router), attention_bias,
fp8-quantized folders, multi-token-prediction layers stored past num_hidden_layers.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.interop import llama
from qkv.interop.common import HFTensors, check_sizes, require
from qkv.interop.moe import FusedExperts
from qkv.interop.registry import ExportRequest, ModelType, register
from qkv.models.gpt import GPT, GPTConfig
from qkv.nn.mla import MLAConfig
from qkv.nn.moe import MoEConfig
from qkv.nn.position import yarn_mscale
from qkv.storage import CheckpointError, unwrap

MODEL_TYPE = "deepseek_v3"
SWIGLU = (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))


def _softmax_scale(hf: Mapping[str, Any], scaling: Mapping[str, Any] | None) -> float | None:
    """transformers' yarn_apply_mscale: with a scaled RoPE that gives mscale_all_dim, the softmax scale
    1/sqrt(qk_head_dim) is multiplied by yarn_mscale(factor, mscale_all_dim)^2 (None: the plain scale)."""
    m_all = (scaling or {}).get("mscale_all_dim")
    if not m_all:
        return None
    qk = int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"])
    return qk ** -0.5 * yarn_mscale(float(scaling["factor"]), float(m_all)) ** 2


def config_from_hf(hf: Mapping[str, Any]) -> GPTConfig:
    """A deepseek_v3 config.json -> GPTConfig with `mla` and `moe`; what we cannot represent is refused."""
    mt = hf.get("model_type")
    require(mt == MODEL_TYPE, f"model_type {mt!r} is not supported by the DeepSeek loader (deepseek_v3 only)")
    require("quantization_config" not in hf, "fp8-quantized DeepSeek folders (quantization_config) are not "
                                             "supported: load a bf16 or fp32 copy")
    require(hf.get("hidden_act", "silu") == "silu", f"hidden_act {hf.get('hidden_act')!r} is not supported")
    heads = int(hf["num_attention_heads"])
    require(
        int(hf.get("num_key_value_heads") or heads) == heads,
        "num_key_value_heads != num_attention_heads: MLA's keys and values come from one latent per token",
    )
    require(
        not hf.get("attention_bias", False), "attention_bias (biases on the MLA projections) is not supported"
    )
    theta, scaling = llama._rope(hf)  # refuses the rules qkv's RoPE does not have
    n_shared = int(hf["n_shared_experts"] or 0)
    require(n_shared >= 1, "n_shared_experts must be >= 1 (transformers always builds the shared experts)")
    q_rank = hf.get("q_lora_rank")
    mla = MLAConfig(
        kv_lora_rank=int(hf["kv_lora_rank"]),
        q_lora_rank=None if q_rank is None else int(q_rank),
        qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]),
        softmax_scale=_softmax_scale(hf, scaling),
    )
    require(mla.kv_lora_rank > 0, "kv_lora_rank must be positive")
    moe = MoEConfig(n_experts=int(hf["n_routed_experts"]), n_experts_per_tok=int(hf["num_experts_per_tok"]),
                    ffn_dim=int(hf["moe_intermediate_size"]), first_k_dense=int(hf["first_k_dense_replace"]),
                    n_shared_experts=n_shared, score="sigmoid", norm_topk=bool(hf["norm_topk_prob"]),
                    n_group=int(hf["n_group"]), topk_group=int(hf["topk_group"]),
                    routed_scaling=float(hf["routed_scaling_factor"]), bias_balance=True, aux_loss_coef=0.0)
    return GPTConfig(
        vocab_size=int(hf["vocab_size"]),
        n_layers=int(hf["num_hidden_layers"]),
        d_model=int(hf["hidden_size"]),
        n_heads=heads,
        head_dim=mla.qk_rope_head_dim,
        d_ff=int(hf["intermediate_size"]),
        ffn="swiglu",
        norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        placement="pre",
        position="rope",
        rope_base=theta,
        rope_scaling=scaling,
        context_length=int(hf.get("max_position_embeddings", 4096)),
        attention="fused",
        bias=False,
        dropout=0.0,
        attn_dropout=float(hf.get("attention_dropout", 0.0)),
        init_std=float(hf.get("initializer_range", 0.02)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        moe=moe,
        mla=mla,
    )


def check_deepseek_sizes(tensors: Any, config: GPTConfig) -> None:
    """config.json's sizes against the file's headers (llama.check_decoder_sizes for MLA and the experts),
    before the key map is expanded per layer and expert or anything is allocated from them."""
    require("model.embed_tokens.weight" in tensors, f"{tensors.source}: no model.embed_tokens.weight")
    c, m, e = config, config.mla, config.moe
    a, H, width = "model.layers.0.self_attn.", c.n_heads, e.ffn_dim or c.d_ff or 4 * c.d_model
    q_key = a + ("q_proj.weight" if m.q_lora_rank is None else "q_b_proj.weight")
    checks: list[tuple[str, Any, str, int | None]] = [
        ("num_hidden_layers", c.n_layers, "model.layers.{}.input_layernorm.weight", None),
        ("vocab_size", c.vocab_size, "model.embed_tokens.weight", 0),
        ("hidden_size", c.d_model, "model.embed_tokens.weight", 1),
        ("kv_lora_rank + qk_rope_head_dim", m.cache_width(), a + "kv_a_proj_with_mqa.weight", 0),
        ("kv_lora_rank", m.kv_lora_rank, a + "kv_b_proj.weight", 1),
        (
            "num_attention_heads * (qk_nope_head_dim + v_head_dim)",
            H * (m.qk_nope_head_dim + m.v_head_dim),
            a + "kv_b_proj.weight",
            0,
        ),
        ("num_attention_heads * v_head_dim", H * m.v_head_dim, a + "o_proj.weight", 1),
        (
            "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)",
            H * (m.qk_nope_head_dim + m.qk_rope_head_dim),
            q_key,
            0,
        ),
        ("q_lora_rank", m.q_lora_rank, a + "q_a_proj.weight", 0),
        ("intermediate_size", c.d_ff, "model.layers.0.mlp.up_proj.weight", 0),
    ]
    if e.first_k_dense < c.n_layers:  # the first MoE layer's router and experts size the rest
        p = f"model.layers.{e.first_k_dense}.mlp."
        require(
            p + "gate.weight" in tensors,
            f"{tensors.source}: no {p}gate.weight, but first_k_dense_replace="
            f"{e.first_k_dense} makes layer {e.first_k_dense} a mixture of experts",
        )
        checks += [("n_routed_experts", e.n_experts, p + "gate.weight", 0),
                   ("moe_intermediate_size", width, p + "experts.0.up_proj.weight", 0),
                   ("moe_intermediate_size * n_shared_experts", width * e.n_shared_experts,
                    p + "shared_experts.up_proj.weight", 0)]
    check_sizes(tensors, tensors.source, checks)


def key_map(config: GPTConfig) -> dict[str, str]:
    """HF -> ours for every parameter (the routers' selection biases are buffers: bias_keys)."""
    c, m = config, config.mla
    out = {"model.embed_tokens.weight": "tok_emb.weight", "model.norm.weight": "decoder.final_norm.weight"}
    if not c.tie_embeddings:
        out["lm_head.weight"] = "lm_head.weight"
    attn = [("kv_a_proj_with_mqa", "kv_a_proj"), ("kv_a_layernorm", "kv_a_norm"), ("kv_b_proj", "kv_b_proj"),
            ("o_proj", "out_proj")]
    attn += [("q_proj", "q_proj")] if m.q_lora_rank is None else \
        [("q_a_proj", "q_a_proj"), ("q_a_layernorm", "q_a_norm"), ("q_b_proj", "q_b_proj")]
    for i in range(c.n_layers):
        hf, ours = f"model.layers.{i}.", f"decoder.blocks.{i}."
        out[hf + "input_layernorm.weight"] = ours + "norm1.weight"
        out[hf + "post_attention_layernorm.weight"] = ours + "norm2.weight"
        out.update({f"{hf}self_attn.{a}.weight": f"{ours}attn.{b}.weight" for a, b in attn})
        if not c.moe.is_moe(i):
            out.update({f"{hf}mlp.{a}.weight": f"{ours}ffn.{b}.weight" for a, b in SWIGLU})
            continue
        out[hf + "mlp.gate.weight"] = ours + "ffn.router.weight"
        out.update({f"{hf}mlp.shared_experts.{a}.weight": f"{ours}ffn.shared.{b}.weight" for a, b in SWIGLU})
        for e in range(c.moe.n_experts):
            out.update(
                {f"{hf}mlp.experts.{e}.{a}.weight": f"{ours}ffn.experts.{e}.{b}.weight" for a, b in SWIGLU}
            )
    return out


def bias_keys(config: GPTConfig) -> dict[str, str]:
    """HF -> ours for the routers' selection biases (persistent buffers of ours, not parameters)."""
    return {f"model.layers.{i}.mlp.gate.e_score_correction_bias": f"decoder.blocks.{i}.ffn.router.score_bias"
            for i in range(config.n_layers) if config.moe.is_moe(i)}


def _deinterleave(rows: int, block: int, rope: int) -> Tensor:
    """Row order that turns interleaved rotary pairs into halves: in each block of `block` rows, the last
    `rope` rows become their even rows followed by their odd ones."""
    idx = torch.arange(rows).view(-1, block)
    tail = idx[:, block - rope:]
    idx[:, block - rope:] = torch.cat([tail[:, 0::2], tail[:, 1::2]], dim=1)
    return idx.reshape(-1)


class DeepseekTensors(Mapping[str, Tensor]):
    """A folder's tensors as the model wants them: the rotary rows of the query and kv_a projections in
    half-split order (when the folder interleaves them), the routers' selection biases left out (fill_model
    fills parameters; load_deepseek copies those buffers)."""

    def __init__(self, tensors: Any, config: GPTConfig, interleaved: bool) -> None:
        self.tensors, self.source = tensors, tensors.source
        self.hidden = set(bias_keys(config))
        m = config.mla
        q = m.qk_nope_head_dim + m.qk_rope_head_dim
        self.orders: dict[str, Tensor] = {}
        if interleaved:
            orders = {"q_proj.weight": (config.n_heads * q, q), "q_b_proj.weight": (config.n_heads * q, q),
                      "kv_a_proj_with_mqa.weight": (m.cache_width(), m.cache_width())}
            self.orders = {suffix: _deinterleave(rows, block, m.qk_rope_head_dim)
                           for suffix, (rows, block) in orders.items()}

    def __iter__(self) -> Iterator[str]:
        return (n for n in self.tensors if n not in self.hidden)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name: object) -> bool:
        return name not in self.hidden and name in self.tensors

    def __getitem__(self, name: str) -> Tensor:
        t = self.tensors[name]
        suffix = name.rsplit("self_attn.", 1)[-1] if ".self_attn." in name else None
        order = self.orders.get(suffix) if suffix else None
        return t if order is None else t.index_select(0, order)

    def meta(self, name: str) -> Tensor:
        return self.tensors.meta(name)


def load_deepseek(folder: Path, hf_config: dict[str, Any]) -> GPT:
    """A DeepseekV3ForCausalLM folder -> our GPT (MLA + MoE), in eval mode, in the dtype of its embedding."""
    config = config_from_hf(hf_config)
    raw: Any = HFTensors(folder)
    if any(name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) for name in raw):
        raw = FusedExperts(raw, MODEL_TYPE)  # transformers 5's fused experts, shown per expert
    check_deepseek_sizes(raw, config)  # before the key map is expanded per layer and expert
    tensors = DeepseekTensors(raw, config, interleaved=bool(hf_config.get("rope_interleave", True)))
    dtype = raw.meta("model.embed_tokens.weight").dtype
    model = llama.empty_model(config, dtype if dtype.is_floating_point else torch.float32)
    llama.fill_model(model, tensors, key_map(config))
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for hf, ours in bias_keys(config).items():
            require(hf in raw, f"{raw.source}: missing key {hf!r}")
            bias = raw[hf]
            if bias.shape != buffers[ours].shape:
                raise CheckpointError(f"{raw.source}: {hf} has shape {tuple(bias.shape)}, expected "
                                      f"{tuple(buffers[ours].shape)}")
            buffers[ours].copy_(bias)
            buffers[ours.replace("score_bias", "load")].zero_()  # the balancing counts start empty
    ids = {
        k: hf_config[k]
        for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        if hf_config.get(k) is not None
    }
    model.folder_generation_config = ids
    return model.eval()


def _refuse_v2(folder: Path, hf_config: dict[str, Any]) -> GPT:
    raise CheckpointError(
        f"{folder}: deepseek_v2 is not supported (its softmax router and group-limited greedy "
        "routing differ from deepseek_v3's); deepseek_v3 folders load"
    )


# -- export ------------------------------------------------------------------------------------------------
def config_to_hf(config: GPTConfig) -> dict[str, Any]:
    """The inverse of config_from_hf, in the half-split rotary layout (rope_interleave false)."""
    m, e = config.mla, config.moe
    require(m.enabled and e.n_experts > 0, "a deepseek_v3 folder has MLA (mla.kv_lora_rank > 0) and experts")
    require(
        e.score == "sigmoid" and e.bias_balance and e.layers is None and not e.shared_expert_gate,
        "deepseek_v3 routes by sigmoid scores with a selection bias (moe.bias_balance), MoE from "
        "first_k_dense on",
    )
    require(
        e.n_shared_experts >= 1
        and e.shared_ffn_dim in (None, e.n_shared_experts * (e.ffn_dim or config.d_ff)),
        "deepseek_v3 has n_shared_experts >= 1 shared experts of moe_intermediate_size each",
    )
    require(m.latent_norm_eps == 1e-6, "deepseek_v3's latent norms use eps 1e-6 (mla.latent_norm_eps)")
    implied = _softmax_scale({"qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim},
                             config.rope_scaling)
    require(m.softmax_scale == implied, f"deepseek_v3 derives the softmax scale from the rope scaling's "
                                        f"mscale_all_dim ({implied}); mla.softmax_scale is {m.softmax_scale}")
    require(
        config.ffn == "swiglu" and config.norm == "rmsnorm" and config.placement == "pre" and not config.bias,
        "deepseek_v3 is Pre-LN RMSNorm / SwiGLU without biases",
    )
    base = llama.config_to_hf(dataclasses.replace(config, mla=MLAConfig(), moe=MoEConfig()), "llama")
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings", "rms_norm_eps", "initializer_range", "tie_word_embeddings",
            "attention_dropout", "rope_parameters", "rope_theta", "rope_scaling")
    out = {k: base[k] for k in keep}
    out.update(model_type=MODEL_TYPE, architectures=["DeepseekV3ForCausalLM"], hidden_act="silu",
               num_key_value_heads=config.n_heads, head_dim=m.qk_rope_head_dim, attention_bias=False,
               kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
               qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, rope_interleave=False,
               n_routed_experts=e.n_experts, num_experts_per_tok=e.n_experts_per_tok,
               moe_intermediate_size=e.ffn_dim or config.d_ff, n_shared_experts=e.n_shared_experts,
               first_k_dense_replace=e.first_k_dense, n_group=e.n_group, topk_group=e.topk_group,
               norm_topk_prob=e.norm_topk, routed_scaling_factor=e.routed_scaling, num_nextn_predict_layers=0)
    return out


def export_deepseek(
    model: GPT, path: str | os.PathLike, *, token_ids: Mapping[str, Any] | None = None
) -> Path:
    """Write `model` as a folder transformers loads as DeepseekV3ForCausalLM (per-expert tensors, config.json,
    in the model's dtype)."""
    model = unwrap(model)
    mapping = {**key_map(model.config), **bias_keys(model.config)}
    return llama.export_decoder(model, path, config_to_hf(model.config), mapping, token_ids)


def write_deepseek(model: GPT, out: Path, request: ExportRequest) -> None:
    export_deepseek(model, out)


SIZING_FIELDS = ("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim", "max_position_embeddings")
register(ModelType(MODEL_TYPE, "decoder", "gpt", load_deepseek, write_deepseek, sizing_fields=SIZING_FIELDS),
         ModelType("deepseek_v2", "decoder", "gpt", _refuse_v2, sizing_fields=SIZING_FIELDS))

__all__ = ["config_from_hf", "config_to_hf", "export_deepseek", "key_map", "load_deepseek"]
