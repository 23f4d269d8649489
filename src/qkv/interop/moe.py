"""Mixture-of-experts decoders (Hugging Face model_type mixtral, qwen2_moe, qwen3_moe) <-> qkv GPT.

Each is a Llama-style decoder (interop/llama.py) whose feed-forward is, in some or all layers, a mixture of
experts (nn/moe.py): Mixtral is Mistral's attention, Qwen2-MoE is Qwen2's (q/k/v biases) with one shared
expert behind a sigmoid gate, Qwen3-MoE is Qwen3's (q/k norms). So the config and the key map are llama.py's,
with the MoE fields and the experts' keys added; loading and export go through the same functions.

  router   HF gate.weight (E, d)                      -> ffn.router.weight
  experts  Mixtral block_sparse_moe.experts.e.w1/w3/w2 -> ffn.experts.e.gate/up/down (silu(w1 x) * w3 x)
           Qwen mlp.experts.e.gate_proj/up_proj/down_proj
  shared   Qwen2-MoE mlp.shared_expert.*, shared_expert_gate.weight (1, d) -> ffn.shared.*, ffn.shared_gate

Folders hold the per-expert layout above (what transformers 5's save_pretrained writes by default, converting
its fused 3-D parameters back, and what the Hub has) or, after save_pretrained(save_original_format=False),
the fused one: mlp.experts.gate_up_proj (E, 2I, d) = [gate; up] per expert, mlp.experts.down_proj (E, d, I),
and Mixtral's router as mlp.gate. FusedExperts shows a fused folder under the per-expert names, so one key map
serves both; export writes the per-expert layout.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.interop import llama
from qkv.interop.common import HFTensors, require
from qkv.interop.registry import ExportRequest, ModelType, register
from qkv.models.gpt import GPT, GPTConfig
from qkv.nn.moe import MoEConfig
from qkv.storage import unwrap

MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
BASE = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}  # the attention each one shares
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
# HF expert projection -> ours, per naming scheme
EXPERT_KEYS = {"mixtral": (("w1", "gate"), ("w3", "up"), ("w2", "down")),
               "qwen": (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))}


def _moe_layers(hf: Mapping[str, Any], n_layers: int, n_experts: int) -> list[int] | None:
    """Qwen's rule for which layers are sparse (decoder_sparse_step, mlp_only_layers); None = all of them."""
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    layers = [i for i in range(n_layers) if i not in dense and n_experts > 0 and (i + 1) % step == 0]
    return None if len(layers) == n_layers else layers


def config_from_hf(hf: Mapping[str, Any]) -> GPTConfig:
    """A mixtral / qwen2_moe / qwen3_moe config.json -> GPTConfig (llama.config_from_hf plus `moe`)."""
    mt = hf.get("model_type")
    require(mt in MODEL_TYPES, f"model_type {mt!r} is not a mixture-of-experts decoder ({MODEL_TYPES})")
    base = llama.config_from_hf({**hf, "model_type": BASE[mt]})
    n_experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
    require(n_experts > 0, f"{mt}: num_experts must be positive")
    k = int(hf.get("num_experts_per_tok", 2))
    coef = float(hf.get("router_aux_loss_coef", 0.02))
    if mt == "mixtral":
        moe = MoEConfig(n_experts=n_experts, n_experts_per_tok=k, norm_topk=True, aux_loss_coef=coef)
        return dataclasses.replace(base, moe=moe)
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if mt == "qwen2_moe" else 0
    require(mt != "qwen2_moe" or shared > 0, f"{mt}: shared_expert_intermediate_size must be positive")
    moe = MoEConfig(
        n_experts=n_experts,
        n_experts_per_tok=k,
        ffn_dim=int(hf["moe_intermediate_size"]),
        layers=_moe_layers(hf, base.n_layers, n_experts),
        norm_topk=bool(hf.get("norm_topk_prob", False)),
        shared_ffn_dim=shared or None,
        shared_expert_gate=bool(shared),
        aux_loss_coef=coef,
    )
    qkv_bias = base.qkv_bias if mt != "qwen2_moe" else (True if hf.get("qkv_bias", True) else None)
    return dataclasses.replace(base, moe=moe, qkv_bias=qkv_bias)


def _layer_keys(mt: str, layer: int, config: GPTConfig) -> dict[str, str]:
    """HF -> ours for one MoE layer's feed-forward."""
    ours = f"decoder.blocks.{layer}.ffn"
    if mt == "mixtral":
        hf, names = f"model.layers.{layer}.block_sparse_moe", EXPERT_KEYS["mixtral"]
    else:
        hf, names = f"model.layers.{layer}.mlp", EXPERT_KEYS["qwen"]
    out = {f"{hf}.gate.weight": f"{ours}.router.weight"}
    for e in range(config.moe.n_experts):
        out.update({f"{hf}.experts.{e}.{a}.weight": f"{ours}.experts.{e}.{b}.weight" for a, b in names})
    if mt == "qwen2_moe":
        out.update(
            {f"{hf}.shared_expert.{a}.weight": f"{ours}.shared.{b}.weight" for a, b in EXPERT_KEYS["qwen"]}
        )
        out[f"{hf}.shared_expert_gate.weight"] = f"{ours}.shared_gate.weight"
    return out


def key_map(config: GPTConfig, model_type: str) -> dict[str, str]:
    """llama.key_map with each MoE layer's dense MLP keys replaced by its router's and experts'."""
    dense = dataclasses.replace(config, moe=MoEConfig())  # llama.py's map knows dense layers only
    moe_layers = [i for i in range(config.n_layers) if config.moe.is_moe(i)]
    prefixes = tuple(f"model.layers.{i}.mlp." for i in moe_layers)
    out = {hf: ours for hf, ours in llama.key_map(dense).items() if not hf.startswith(prefixes)}
    for i in moe_layers:
        out.update(_layer_keys(model_type, i, config))
    return out


class FusedExperts(Mapping[str, Tensor]):
    """A folder's tensors (HFTensors) with transformers 5's fused expert parameters shown as the per-expert
    tensors of the default layout. A fused tensor is read when its first expert is asked for and kept until
    another one is (the loader copies a layer's experts one after another): one layer's experts in memory
    beside the model."""

    FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.(experts\.(gate_up_proj|down_proj)|gate\.weight)")

    def __init__(self, tensors: HFTensors, model_type: str) -> None:
        self.tensors, self.source = tensors, tensors.source
        self.views: dict[str, tuple[str, int | None, slice]] = {}  # name -> (file name, expert, rows)
        self._held: tuple[str | None, Tensor | None] = (None, None)
        mixtral = model_type == "mixtral"
        names = dict(EXPERT_KEYS["mixtral" if mixtral else "qwen"])  # HF projection -> ours, inverted below
        gate, up, down = (next(a for a, b in names.items() if b == x) for x in ("gate", "up", "down"))
        for name in tensors:
            m = self.FUSED.fullmatch(name)
            if m is None or not (mixtral or m.group(3)):  # Qwen's router keeps its name
                continue
            prefix = f"model.layers.{m.group(1)}.{'block_sparse_moe' if mixtral else 'mlp'}"
            if m.group(3) is None:
                self.views[f"{prefix}.gate.weight"] = (name, None, slice(None))
                continue
            E, rows = tensors.meta(name).shape[:2]
            parts = (
                ((gate, slice(0, rows // 2)), (up, slice(rows // 2, rows)))
                if m.group(3) == "gate_up_proj"
                else ((down, slice(None)),)
            )
            for e in range(E):
                for proj, r in parts:
                    self.views[f"{prefix}.experts.{e}.{proj}.weight"] = (name, e, r)
        self.hidden = {file for file, _, _ in self.views.values()}

    def __iter__(self) -> Iterator[str]:
        return iter([*(n for n in self.tensors if n not in self.hidden), *self.views])

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __contains__(self, name: object) -> bool:
        return name in self.views or (name in self.tensors and name not in self.hidden)

    def _file_tensor(self, name: str) -> Tensor:
        if self._held[0] != name:
            self._held = (None, None)  # the previous layer's experts first
            self._held = (name, self.tensors[name])
        return self._held[1]

    def __getitem__(self, name: str) -> Tensor:
        if name in self.hidden:
            raise KeyError(name)
        if name not in self.views:
            return self.tensors[name]
        file, e, rows = self.views[name]
        return self._file_tensor(file) if e is None else self._file_tensor(file)[e, rows]

    def meta(self, name: str) -> Tensor:
        if name not in self.views:
            return self.tensors.meta(name)
        file, e, rows = self.views[name]
        t = self.tensors.meta(file)
        return t if e is None else torch.empty_like(t[e, rows], device="meta")


def load_moe(folder: Path, hf_config: dict[str, Any]) -> GPT:
    """A MixtralForCausalLM / Qwen2MoeForCausalLM / Qwen3MoeForCausalLM folder -> our GPT (eval mode)."""
    config = config_from_hf(hf_config)
    mt = hf_config["model_type"]
    tensors: Any = HFTensors(folder)
    if any(name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) for name in tensors):
        tensors = FusedExperts(tensors, mt)
    llama.check_decoder_sizes(tensors, config)  # before the key map is expanded per layer
    return llama.load_decoder(folder, hf_config, config, key_map(config, mt), tensors)


# -- export ------------------------------------------------------------------------------------------------
def model_type_of(config: GPTConfig) -> str:
    """qwen2_moe (a gated shared expert), qwen3_moe (q/k norms), else mixtral."""
    if config.moe.shared_expert_gate:
        return "qwen2_moe"
    return "qwen3_moe" if config.qk_norm else "mixtral"


def _check_exportable(config: GPTConfig, mt: str) -> None:
    m = config.moe
    require(
        m.n_experts > 0, f"a dense model is not a {mt} folder: export it with qkv.interop.llama.export_llama"
    )
    require(m.score == "softmax" and m.n_group == 1 and m.routed_scaling == 1.0 and not m.bias_balance,
            f"{mt} routes by softmax top-k only (no sigmoid scores, groups, scaling or selection bias)")
    require(mt == "qwen2_moe" or not (m.n_shared_experts or m.shared_ffn_dim),
            f"{mt} has no shared expert (qwen2_moe has one, behind a sigmoid gate)")
    require(mt != "qwen2_moe" or (m.shared_expert_gate and (m.shared_ffn_dim or m.n_shared_experts)),
            "qwen2_moe has one gated shared expert (moe.shared_expert_gate with shared_ffn_dim)")
    if mt == "mixtral":
        require(m.norm_topk, "mixtral always renormalises the chosen experts' weights (moe.norm_topk)")
        require(all(m.is_moe(i) for i in range(config.n_layers)), "mixtral has experts in every layer")
        require(
            m.ffn_dim in (None, config.d_ff),
            "mixtral's experts are intermediate_size wide (moe.ffn_dim = d_ff)",
        )


def config_to_hf(config: GPTConfig, model_type: str | None = None) -> dict[str, Any]:
    """The inverse of config_from_hf: llama.config_to_hf of the attention, plus the MoE fields."""
    mt = model_type or model_type_of(config)
    require(mt in MODEL_TYPES, f"cannot export to model_type {mt!r}; choose one of {MODEL_TYPES}")
    _check_exportable(config, mt)
    m = config.moe
    # llama.py checks the attention as the base type's (Qwen2's q/k/v biases are that type's, not optional)
    attention = dataclasses.replace(
        config, moe=MoEConfig(), qkv_bias=True if mt == "qwen2_moe" else config.qkv_bias
    )
    out = llama.config_to_hf(attention, BASE[mt])
    out.update(model_type=mt, architectures=[ARCHITECTURES[mt]], num_experts_per_tok=m.n_experts_per_tok,
               router_aux_loss_coef=m.aux_loss_coef, output_router_logits=False)
    if mt == "mixtral":
        out.update(num_local_experts=m.n_experts, router_jitter_noise=0.0)
        return out
    width = m.ffn_dim or config.d_ff or 4 * config.d_model
    dense = [i for i in range(config.n_layers) if not m.is_moe(i)]
    out.update(num_experts=m.n_experts, moe_intermediate_size=width, norm_topk_prob=m.norm_topk,
               decoder_sparse_step=1, mlp_only_layers=dense)
    if mt == "qwen2_moe":
        out.update(shared_expert_intermediate_size=m.shared_ffn_dim or m.n_shared_experts * width,
                   qkv_bias=bool(config.qkv_bias))
    return out


def export_moe(model: GPT, path: str | os.PathLike, *, model_type: str | None = None,
               token_ids: Mapping[str, Any] | None = None) -> Path:
    """Write `model` as a Hugging Face folder transformers loads as MixtralForCausalLM / Qwen2MoeForCausalLM /
    Qwen3MoeForCausalLM (per-expert tensors, config.json, in the model's dtype)."""
    model = unwrap(model)
    mt = model_type or model_type_of(model.config)
    return llama.export_decoder(
        model, path, config_to_hf(model.config, mt), key_map(model.config, mt), token_ids
    )


def write_moe(model: GPT, out: Path, request: ExportRequest) -> None:
    export_moe(model, out, model_type=request.model_type)


register(*(ModelType(mt, "decoder", "gpt", load_moe, write_moe, sizing_fields=llama.SIZING_FIELDS)
           for mt in MODEL_TYPES))

__all__ = ["config_from_hf", "config_to_hf", "export_moe", "key_map", "load_moe", "model_type_of"]
