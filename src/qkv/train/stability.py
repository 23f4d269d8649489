"""Stability diagnostics: per-layer gradient/weight norms and the non-finite (NaN/inf) guard.

A non-finite loss or gradient is detected after backward and before the optimizer step, so a bad
update never reaches the weights. TrainConfig.nan_policy then decides:
  skip      drop this update (zero the gradients), count it, go on (stop after max_skips, default 10);
  stop      save a checkpoint (the weights before the bad update; not if they are already non-finite,
            and never pruning a good one for it) and the offending micro-batches, raise NonFiniteError
            naming the step and the layers whose gradients blew up;
  rollback  reload the last good checkpoint, multiply the LR by rollback_lr_factor, go on
            (NonFiniteError after max_rollbacks).
Under fp16 the GradScaler owns non-finite *gradients* (it skips the step and lowers the scale; that is
its normal operation); the policy then applies to a non-finite loss only.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from torch import nn

_LAYER_RE = re.compile(r"^(.*?blocks\.\d+)\.")


class NonFiniteError(RuntimeError):
    """Training met a non-finite loss or gradient and the policy said stop. The message is the report."""

    def __init__(self, message: str, *, step: int, loss: float, grad_norm: float, layers: list[str],
                 checkpoint: Path | None = None, batch_path: Path | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.loss = loss
        self.grad_norm = grad_norm
        self.layers = layers
        self.checkpoint = checkpoint
        self.batch_path = batch_path


def layer_of(param_name: str) -> str:
    """'decoder.blocks.3.attn.qkv_proj.weight' -> 'decoder.blocks.3'; 'tok_emb.weight' -> 'tok_emb'."""
    for prefix in ("_orig_mod.", "module."):
        param_name = param_name.replace(prefix, "")
    m = _LAYER_RE.match(param_name)
    if m:
        return m.group(1)
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


def module_of(param_name: str) -> str:
    for prefix in ("_orig_mod.", "module."):
        param_name = param_name.replace(prefix, "")
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


def _norm(t: torch.Tensor) -> torch.Tensor:
    """L2 norm as a float32 scalar; a sharded DTensor (FSDP2) is reduced over its mesh (collective)."""
    n = torch.linalg.vector_norm(t.detach().float())
    return n.full_tensor() if hasattr(n, "full_tensor") else n


def layer_norms(model: nn.Module) -> dict[str, float]:
    """{'grad/<layer>': ..., 'weight/<layer>': ...}: L2 norms per layer (blocks.i, embeddings, heads)."""
    grad_sq: dict[str, torch.Tensor] = {}
    weight_sq: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        layer = layer_of(name)
        w = _norm(p) ** 2
        weight_sq[layer] = weight_sq.get(layer, 0) + w
        if p.grad is not None:
            grad_sq[layer] = grad_sq.get(layer, 0) + _norm(p.grad) ** 2
    out = {f"grad/{k}": math.sqrt(float(v)) for k, v in grad_sq.items()}
    out.update({f"weight/{k}": math.sqrt(float(v)) for k, v in weight_sq.items()})
    return out


def nonfinite_grads(model: nn.Module, top: int = 8) -> list[str]:
    """Modules whose gradients hold NaN/inf (in parameter order, i.e. from the input side), or, when all
    gradients are finite, the `top` modules with the largest gradient norms (marked with their norm)."""
    bad, norms = [], []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        n = float(_norm(p.grad))
        mod = module_of(name)
        if not math.isfinite(n):
            if mod not in bad:
                bad.append(mod)
        else:
            norms.append((n, mod))
    if bad:
        return bad
    norms.sort(reverse=True)
    return [f"{mod} (grad norm {n:.3g})" for n, mod in norms[:top]]


def report(step: int, loss: float, grad_norm: float, layers: list[str], checkpoint: Path | None,
           batch_path: Path | None, what: str = "stop", newest_good: Path | None = None) -> str:
    which = "loss" if not math.isfinite(loss) else "gradient"
    shown = ", ".join(layers[:8]) + (f" (+{len(layers) - 8} more)" if len(layers) > 8 else "")
    lines = [f"non-finite {which} at step {step} (loss={loss:.6g}, grad_norm={grad_norm:.6g}); "
             f"nan_policy={what}.",
             f"  gradients blew up in: {shown or '(no gradients)'}"]
    if checkpoint is not None:
        lines.append(f"  weights before this step saved to: {checkpoint}")
    else:
        lines.append("  weights before this step are not finite (an earlier update overflowed): not saved; "
                     f"newest good checkpoint: {newest_good or 'none'}")
    if batch_path is not None:
        lines.append(f"  offending batch saved to: {batch_path} (torch.load(path, weights_only=True))")
    lines.append("  try: a lower lr, a longer warmup, clip_grad, precision=bf16 instead of fp16, "
                 "or check the batch for over-long or corrupt sequences")
    return "\n".join(lines)
