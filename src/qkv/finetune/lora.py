"""LoRA: low-rank adapters on frozen linear layers (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large
Language Models").

    y = W x + b + (alpha / r) * B A dropout(x)        A: (r, in), B: (out, r); B starts at zero

Only A and B train; W and b stay frozen. After training, `merge_lora` folds B A into W, so the fine-tuned
model is an ordinary model again (same architecture, same speed, loadable anywhere).

Why our own module and not `peft`: peft replaces each target with its own wrapper around the original layer
(`lora.Linear(base_layer)`), which (1) hides the module's type, by which qkv finds its projections; (2)
renames the state-dict keys (`qkv_proj.base_layer.weight`), so checkpoints and the interop key maps stop
matching; (3) cannot adapt one part of a fused projection: our self-attention computes Q, K and V with one
`qkv_proj` matmul, and the LoRA paper's default (adapt W_q and W_v) needs separate adapters on slices of its
output; (4) pulls in `transformers` and `accelerate` as hard dependencies of the library. The module below is
a subclass of qkv's Linear holding the *same* weight and bias Parameters (keys unchanged, tying preserved)
plus A/B pairs for output slices; its forward serves training and decoding alike.

Targets (comma separated in `--lora-targets`):
  q, k, v        the query / key / value slice of a fused self-attention projection (qkv_proj), or a
                 cross-attention's q_proj / the k, v slices of its kv_proj. Multi-head latent attention
                 (nn/mla.py) has no such slices: q is its whole query projection (q_proj, or the up-projection
                 q_b_proj with a query bottleneck), k and v are kv_b_proj, whole (the latent's up-projection
                 into every head's non-rotary key and value, their rows interleaved head by head)
  q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj   the Hugging Face (Llama) names of the same
  q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj                 DeepSeek's MLA projections (whole)
  out_proj, qkv_proj, up, gate, down, lm_head, ...                  any Linear by its own (last) name: gate,
                                                                    up, down include every expert of a
                                                                    mixture-of-experts layer (nn/moe.py)
  *.blocks.0.*   a glob with `*` or `.`, matched against the full module name
  all-linear     every Linear except the output head, a fused projection as its q, k, v slices: the same
                 adapters as listing every Linear's Hugging Face name
                 (q_proj,k_proj,v_proj,o_proj,gate_proj,...), i.e. PEFT's all-linear on a model whose q, k and
                 v are separate Linears (Llama, Qwen, BERT, T5, ...; not GPT-2, whose c_attn is one fused
                 Conv1D there)
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.config import ConfigError
from qkv.nn.attention import MultiHeadAttention
from qkv.nn.linear import Linear
from qkv.nn.mla import MultiHeadLatentAttention
from qkv.nn.params import count_parameters

# Hugging Face (Llama/Mistral/Qwen) module names -> ours
HF_ALIASES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "out_proj", "gate_proj": "gate",
              "up_proj": "up", "down_proj": "down", "kv_a_proj_with_mqa": "kv_a_proj"}
SLICE_TARGETS = ("q", "k", "v")
# multi-head latent attention: the Linears that q, k and v stand for, each adapted whole
MLA_ROLES = {"q": ("q_proj", "q_b_proj"), "k": ("kv_b_proj",), "v": ("kv_b_proj",)}
HEADS = ("lm_head",)  # output heads: never part of all-linear


@dataclass
class LoRAConfig:
    rank: int = 8  # r: the rank of the update B A
    alpha: float = 16.0  # the update is scaled by alpha / rank (so changing r does not change the LR to use)
    dropout: float = 0.0  # dropout on the adapter's input only
    targets: list[str] = field(default_factory=lambda: ["q", "v"])  # the LoRA paper's choice: W_q and W_v

    def validate(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"--lora-rank must be at least 1, got {self.rank}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ConfigError(f"--lora-alpha must be a positive number, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"--lora-dropout must be in [0, 1), got {self.dropout}")
        if not self.targets or any(not t for t in self.targets):
            raise ConfigError("--lora-targets needs at least one module name (e.g. q,v or all-linear)")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoRALinear(Linear):
    """A qkv Linear with LoRA adapters on output slices [start, stop). Holds the *same* weight and bias
    Parameter objects as the layer it replaces (state-dict keys unchanged, tied weights stay tied), plus
    lora_A.i (r, in) and lora_B.i (stop - start, r) for slice i."""

    def __init__(self, base: nn.Linear, slices: list[tuple[int, int]], rank: int, alpha: float,
                 dropout: float = 0.0) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a new weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)  # registered even when None, as nn.Linear does
        self.slices = tuple(sorted(slices))
        for (a, b), (c, _) in zip(self.slices, self.slices[1:]):
            if c < b:
                raise ConfigError(f"LoRA targets overlap on the same layer (output slices {a}:{b} and "
                                  f"{c}:...)")
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        w = base.weight
        # adapters train in fp32 even on a bf16/fp16 model: AdamW on half-precision weights loses small
        # updates
        dtype = w.dtype if w.dtype in (torch.float32, torch.float64) else torch.float32
        self.lora_A = nn.ParameterList()
        self.lora_B = nn.ParameterList()
        for a, b in self.slices:
            A = torch.empty(rank, self.in_features, dtype=dtype, device=w.device)
            nn.init.kaiming_uniform_(A, a=math.sqrt(5))  # nn.Linear's (and the reference code's) init
            self.lora_A.append(nn.Parameter(A))
            self.lora_B.append(nn.Parameter(torch.zeros(b - a, rank, dtype=dtype, device=w.device)))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, lora_rank={self.rank}, lora_alpha={self.alpha}, "
                f"slices={list(self.slices)}, merged={self.merged}")

    def _delta(self, h: Tensor, i: int) -> Tensor:
        A, B = self.lora_A[i], self.lora_B[i]
        if not torch.is_autocast_enabled(h.device.type):
            h = h.to(A.dtype)
        return F.linear(F.linear(h, A), B) * self.scaling

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        if self.merged or not self.slices:
            return y
        h = self.lora_dropout(x)
        if self.slices == ((0, self.out_features),):
            return y + self._delta(h, 0).to(y.dtype)
        parts, pos = [], 0  # out of place (autograd): untouched columns, adapted slices, in output order
        for i, (a, b) in enumerate(self.slices):
            if pos < a:
                parts.append(y[..., pos:a])
            parts.append(y[..., a:b] + self._delta(h, i).to(y.dtype))
            pos = b
        if pos < self.out_features:
            parts.append(y[..., pos:])
        return torch.cat(parts, dim=-1)

    @torch.no_grad()
    def delta_weight(self) -> list[tuple[int, int, Tensor]]:
        """[(start, stop, scaling * B A)] in fp32: what merge() adds to the weight rows start:stop."""
        return [(a, b, (self.lora_B[i].float() @ self.lora_A[i].float()) * self.scaling)
                for i, (a, b) in enumerate(self.slices)]

    @torch.no_grad()
    def merge(self) -> None:
        """W[start:stop] += scaling * B A, in place."""
        if not self.merged:
            for a, b, d in self.delta_weight():
                self.weight[a:b] += d.to(self.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            for a, b, d in self.delta_weight():
                self.weight[a:b] -= d.to(self.weight.dtype)
            self.merged = False

    def plain(self) -> Linear:
        """A plain qkv Linear on the same (merged or not) weight and bias: the adapters dropped."""
        lin = Linear.__new__(Linear)
        nn.Module.__init__(lin)
        lin.in_features, lin.out_features = self.in_features, self.out_features
        lin.weight = self.weight
        lin.register_parameter("bias", self.bias)
        return lin


# -- choosing the layers ----------------------------------------------------------------------------------
def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name}


def _slices_of(model: nn.Module, name: str, which: str) -> tuple[int, int] | None:
    """The output slice of q/k/v inside the linear `name` (a fused projection), or None if it has none."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, MultiHeadLatentAttention):
        return (0, getattr(parent, leaf).out_features) if leaf in MLA_ROLES[which] else None
    if not isinstance(parent, MultiHeadAttention):
        return None
    # q width may differ from d_model
    C, kv = parent.n_heads * parent.head_dim, parent.n_kv_heads * parent.head_dim
    if leaf == "qkv_proj":
        return {"q": (0, C), "k": (C, C + kv), "v": (C + kv, C + 2 * kv)}[which]
    if leaf == "q_proj" and which == "q":
        return (0, C)
    if leaf == "kv_proj" and which in ("k", "v"):
        return {"k": (0, kv), "v": (kv, 2 * kv)}[which]
    return None


def resolve_targets(model: nn.Module, targets: list[str]) -> dict[str, list[tuple[int, int]]]:
    """{module name: [(start, stop) output slices]} for the targets; a target matching nothing is an error."""
    linears = _linears(model)
    chosen: dict[str, set[tuple[int, int]]] = {}
    for raw in targets:
        t = HF_ALIASES.get(raw.strip(), raw.strip())
        hits: list[tuple[str, tuple[int, int]]] = []
        for name, lin in linears.items():
            leaf = name.rpartition(".")[2]
            full = (0, lin.out_features)
            if t in SLICE_TARGETS:
                s = _slices_of(model, name, t)
                if s is not None:
                    hits.append((name, s))
            elif t == "all-linear":
                if leaf not in HEADS:
                    # a fused projection (self-attention's qkv_proj, cross-attention's kv_proj) stands for the
                    # separate q/k/v Linears of the Hugging Face model: one adapter per slice, as q,k,v give
                    parts = [s for s in (_slices_of(model, name, w) for w in SLICE_TARGETS) if s is not None]
                    hits.extend((name, s) for s in parts or [full])
            elif "*" in t or "." in t or "?" in t:
                if fnmatch.fnmatchcase(name, t):
                    hits.append((name, full))
            elif leaf == t:
                hits.append((name, full))
        if not hits:
            leaves = sorted({n.rpartition(".")[2] for n in linears} | set(SLICE_TARGETS))
            raise ConfigError(f"LoRA target {raw!r} matches no linear layer of this model; "
                              f"layer names: {', '.join(leaves)} (or a glob like '*.blocks.0.*', or "
                              "all-linear)")
        for name, s in hits:
            chosen.setdefault(name, set()).add(s)
    out = {}
    for name, slices in chosen.items():
        ordered = sorted(slices)
        full = (0, linears[name].out_features)
        if full in ordered and len(ordered) > 1:  # e.g. qkv_proj and q: the whole layer covers the slice
            ordered = [full]
        out[name] = ordered
    return out


def _tied(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def apply_lora(model: nn.Module, config: LoRAConfig) -> dict[str, Any]:
    """Freeze every parameter of `model` and put LoRA adapters on the target layers (in place). Returns
    {"modules": {name: slices}, "trainable": n, "total": n} (parameters, tied ones once)."""
    config.validate()
    plan = resolve_targets(model, config.targets)
    tied = _tied(model)
    for p in model.parameters():
        p.requires_grad_(False)
    for name, slices in plan.items():
        lin = model.get_submodule(name)
        if isinstance(lin, LoRALinear):
            raise ConfigError(f"{name} already has LoRA adapters")
        shared = [n for n in tied[id(lin.weight)] if n != f"{name}.weight"]
        if shared:
            raise ConfigError(f"LoRA target {name} shares its weight with {shared[0]} (tied embeddings): "
                              f"merging the adapter would change that too; choose other targets")
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, LoRALinear(lin, slices, config.rank, config.alpha, config.dropout))

    return {"modules": plan, "trainable": count_parameters(model, trainable_only=True),
            "total": count_parameters(model)}


def lora_layers(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def merge_lora(model: nn.Module) -> nn.Module:
    """Merge every adapter into its weight (W += alpha/r B A) and put plain Linears back: the model is an
    ordinary model again (adapters gone, every parameter trainable, as without LoRA)."""
    for name, m in lora_layers(model):
        m.merge()
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, m.plain())
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def set_merged(model: nn.Module, merged: bool) -> None:
    """Merge (True) or unmerge (False) every adapter in place, keeping the adapters."""
    for _, m in lora_layers(model):
        m.merge() if merged else m.unmerge()


__all__ = ["HF_ALIASES", "LoRAConfig", "LoRALinear", "apply_lora", "lora_layers",
           "merge_lora", "resolve_targets", "set_merged"]
