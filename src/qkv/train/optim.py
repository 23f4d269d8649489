"""AdamW with two parameter groups: weight decay on weight matrices only.

Decay pulls parameters toward zero; for norm gains (which should stay near 1), biases and embeddings
(rows updated only when their token appears) that is a regulariser nobody asked for, so they get
weight_decay 0 (GPT-2/nanoGPT practice for norms and biases; BERT's recipe also exempts embeddings).
The groups are built once, before any wrapping, and their sizes are logged at the start of training.

Which AdamW implementation runs the update (`TrainConfig.optimizer_impl`): torch has three that compute the
same update, and its default is NOT the fastest one on CPU: with foreach=None/fused=None, `torch.optim.AdamW`
takes the multi-tensor (foreach) path only for CUDA tensors and runs a Python loop over the parameters, seven
elementwise kernels each, on CPU. "auto" picks the fused kernel (one pass per tensor, all of Adam's arithmetic
in it; CPU and CUDA since torch 2.4) where every parameter allows it, else foreach. Measured on a
10.8M-parameter GPT (76 tensors, 2 AVX2 threads): loop ~98 ms, foreach ~86 ms, fused ~21 ms per step. The
three agree to float rounding (tests/train/test_optim.py), not bit for bit: a run resumed with another
implementation continues correctly but not bit-identically.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import nn

from qkv.config import ConfigError
from qkv.nn.position import PositionalEncoding

# words of a parameter's own name (split on "_" and ".") that mark an embedding-like table: whole words, so
# `ensemble_weight` or `decomposition` are not caught by the "emb" / "position" inside them
_NO_DECAY_WORDS = frozenset({"emb", "embed", "embeds", "embedding", "embeddings", "pos", "position",
                             "positions", "positional"})
_NO_DECAY_PAIRS = frozenset({("cls", "token"), ("mask", "token")})

OptimizerImpl = Literal["auto", "fused", "foreach", "loop"]
OPTIMIZER_IMPLS: tuple[str, ...] = get_args(OptimizerImpl)
# devices with a fused AdamW kernel in every torch this package supports (torch>=2.6; CPU's came in 2.4)
_FUSED_DEVICES = ("cpu", "cuda")


@dataclass
class GroupSummary:
    decay_tensors: int
    decay_params: int
    no_decay_tensors: int
    no_decay_params: int

    def line(self) -> str:
        return (f"param groups: decay {self.decay_tensors} tensors / {self.decay_params:,} params; "
                f"no decay (norms, biases, embeddings) {self.no_decay_tensors} tensors / "
                f"{self.no_decay_params:,} params")


def no_decay_names(model: nn.Module) -> set[str]:
    """Names of the parameters that must not be decayed: 0-/1-D tensors (norm gains, biases), anything
    owned by an nn.Embedding or a positional encoding, and parameters named like an embedding."""
    names = set()
    for mod_name, mod in model.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if p.dim() < 2 or isinstance(mod, (nn.Embedding, PositionalEncoding)) or _embedding_like(p_name):
                names.add(full)
    return names


def _embedding_like(name: str) -> bool:
    words = re.split(r"[._]", name.lower())
    return (bool(_NO_DECAY_WORDS.intersection(words))
            or any(pair in _NO_DECAY_PAIRS for pair in zip(words, words[1:])))


def param_groups(model: nn.Module, weight_decay: float) -> tuple[list[dict], GroupSummary]:
    """[{'params': decayed, 'weight_decay': wd}, {'params': others, 'weight_decay': 0}], tied weights once.

    A tied parameter (GPT's LM head = token embedding) is classified by any of its names: if one of them
    is an embedding, the tensor is not decayed."""
    skip = no_decay_names(model)
    by_id: dict[int, tuple[nn.Parameter, bool]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue
        decay = name not in skip
        if id(p) in by_id:
            decay = decay and by_id[id(p)][1]
        by_id[id(p)] = (p, decay)
    # order follows named_parameters (first occurrence), so group contents are deterministic
    decay_params = [p for p, d in by_id.values() if d]
    other_params = [p for p, d in by_id.values() if not d]
    summary = GroupSummary(len(decay_params), sum(p.numel() for p in decay_params),
                           len(other_params), sum(p.numel() for p in other_params))
    groups = [{"params": decay_params, "weight_decay": weight_decay, "name": "decay"},
              {"params": other_params, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]], summary


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor that holds the numbers (an FSDP2 DTensor's local shard, else the tensor itself)."""
    return p.to_local() if hasattr(p, "to_local") else p


def fused_supported(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW accepts every parameter: floating point, on CPU or CUDA."""
    return bool(params) and all(_local(p).is_floating_point() and _local(p).device.type in _FUSED_DEVICES
                                for p in params)


def resolve_impl(impl: str, params: list[torch.Tensor]) -> str:
    """"fused", "foreach" or "loop" for `impl` (one of OPTIMIZER_IMPLS): "auto" is fused where supported,
    else foreach (torch's multi-tensor path runs on any device: a C++ fallback where there is no kernel)."""
    if impl not in OPTIMIZER_IMPLS:
        raise ConfigError(f"optimizer_impl {impl!r} is not one of {', '.join(OPTIMIZER_IMPLS)}")
    if impl == "auto":
        return "fused" if fused_supported(params) else "foreach"
    if impl == "fused" and not fused_supported(params):
        kinds = sorted({f"{_local(p).device.type}/{_local(p).dtype}" for p in params})
        raise ConfigError(f"optimizer_impl=fused: torch's fused AdamW needs floating-point parameters on "
                          f"{' or '.join(_FUSED_DEVICES)}, these are {', '.join(kinds)}; use auto or foreach")
    return impl


def _flags(impl: str) -> dict[str, Any]:
    # both flags explicit: foreach=None would let torch choose (the loop on CPU), fused=None means False
    return {"fused": impl == "fused", "foreach": impl == "foreach"}


def set_impl(optimizer: torch.optim.Optimizer, impl: str) -> None:
    """Make `optimizer` run `impl` ("fused", "foreach" or "loop"), e.g. after load_state_dict, which replaces
    the param groups' settings with the saved ones (a checkpoint written before this option had foreach=None,
    fused=None, i.e. the loop on CPU). Moves each `step` counter where the implementation keeps it: fused
    keeps it as a float32 tensor on the parameter's device, the others as a CPU tensor; the values are
    unchanged."""
    flags = _flags(impl)
    for group in optimizer.param_groups:
        group.update(flags)
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and torch.is_tensor(state.get("step")):
                device = _local(p).device if impl == "fused" else torch.device("cpu")
                if not group.get("capturable", False):
                    state["step"] = state["step"].to(device=device, dtype=torch.float32)
    # torch.optim.Adam sets this in __init__ for fused only: the GradScaler then hands the fused kernel its
    # scale instead of unscaling the gradients itself
    optimizer._step_supports_amp_scaling = impl == "fused"  # type: ignore[attr-defined]


def build_optimizer(model: nn.Module, *, lr: float, betas: tuple[float, float] | list[float], eps: float,
                    weight_decay: float, impl: str = "auto") -> tuple[torch.optim.AdamW, GroupSummary]:
    """AdamW over `param_groups(model, weight_decay)`, run by `impl` (auto | fused | foreach | loop; see the
    module docstring). The implementation chosen is `implementation(optimizer)`."""
    groups, summary = param_groups(model, weight_decay)
    chosen = resolve_impl(impl, [p for g in groups for p in g["params"]])
    opt = torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, **_flags(chosen))
    return opt, summary


def implementation(optimizer: torch.optim.Optimizer) -> str:
    """"fused", "foreach" or "loop": what the optimizer's param groups run now (a group's foreach=None means
    torch's own choice: foreach for CUDA tensors, the loop elsewhere)."""
    group = optimizer.param_groups[0]
    if group.get("fused"):
        return "fused"
    foreach = group.get("foreach")
    if foreach is None:
        foreach = all(_local(p).device.type == "cuda" for p in group["params"])
    return "foreach" if foreach else "loop"
