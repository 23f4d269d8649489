"""AdamW with two parameter groups: weight decay on weight matrices only.

Decay pulls parameters toward zero; for norm gains (which should stay near 1), biases and embeddings
(rows updated only when their token appears) that is a regulariser nobody asked for, so they get
weight_decay 0 (GPT-2/nanoGPT practice for norms and biases; BERT's recipe also exempts embeddings).
The groups are built once, before any wrapping, and their sizes are logged at the start of training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from qkv.nn.position import PositionalEncoding

_NO_DECAY_NAME_PARTS = ("emb", "cls_token", "pos_", "position", "mask_token")


@dataclass
class GroupSummary:
    decay_tensors: int
    decay_params: int
    no_decay_tensors: int
    no_decay_params: int

    def line(self) -> str:
        return (f"param groups: decay {self.decay_tensors} tensors / {self.decay_params:,} params; "
                f"no decay (norms, biases, embeddings) {self.no_decay_tensors} tensors / {self.no_decay_params:,} params")


def no_decay_names(model: nn.Module) -> set[str]:
    """Names of the parameters that must not be decayed: 0-/1-D tensors (norm gains, biases), anything
    owned by an nn.Embedding or a positional encoding, and parameters named like an embedding."""
    names = set()
    for mod_name, mod in model.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if p.dim() < 2 or isinstance(mod, (nn.Embedding, PositionalEncoding)) \
                    or any(part in p_name.lower() for part in _NO_DECAY_NAME_PARTS):
                names.add(full)
    return names


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


def build_optimizer(model: nn.Module, *, lr: float, betas: tuple[float, float] | list[float], eps: float,
                    weight_decay: float) -> tuple[torch.optim.AdamW, GroupSummary]:
    groups, summary = param_groups(model, weight_decay)
    # foreach=None lets torch pick the multi-tensor path where it is supported (it is on CPU and CUDA)
    opt = torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps)
    return opt, summary
