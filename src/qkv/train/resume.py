"""The pieces of where Trainer.fit() starts (Trainer.begin puts them together), and what a checkpoint
restores: the repair of what a killed process left, resume (train.resume / --resume), checkpoints/best's
record, the notes on changed settings, and the weights, optimizer and RNG states read back.

A run starts fresh only in an empty checkpoints folder: a fresh run's pruning would keep an older run's
higher steps and delete its own, so checkpoints of another run are an error rather than silently mixed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qkv.checkpoint import CheckpointError, check_state_fits
from qkv.config import ConfigError
from qkv.train import checkpoint as ckpt
from qkv.train import distributed as dist_
from qkv.train.config import TrainConfig
from qkv.train.optim import set_impl
from qkv.train.precision import Precision
from qkv.train.rng import seed_everything, set_rng_state
from qkv.train.state import TrainState

# the settings a resumed run may change at the price of an inexact continuation (listed in a note)
NOTED_CHANGES = ("batch_size", "seed", "schedule", "lr", "max_steps", "warmup", "weight_decay", "betas",
                 "eps")


@dataclass
class Start:
    """How fit() begins: the checkpoint it resumed from (None: a fresh start), what the repair of the
    checkpoints folder did, and the note of a resume that found nothing to resume."""

    resumed_from: Path | None = None
    repaired: list[str] = field(default_factory=list)
    fresh_note: str = ""


def repair(root: Path, info: dist_.DistInfo) -> list[str]:
    """Repair what a killed process left in the checkpoints folder (rank 0, before anything is read or
    written there); the lines saying what was done."""
    repaired = ckpt.clean_stale(root) if info.is_main else []
    dist_.barrier(info)
    return repaired


def check_fresh(root: Path) -> None:
    """A fresh run starts only in an empty checkpoints folder."""
    existing = ckpt.list_checkpoints(root)
    if existing:
        raise ConfigError(
            f"{root} already holds checkpoints of another run (up to step "
            f"{existing[-1][0]}): resume=True continues it; a new run needs another out_dir"
        )


def best_after_resume(root: Path, best: dict[str, Any] | None, metric: str,
                      is_better: Callable[[float, dict[str, Any] | None], bool],
                      info: dist_.DistInfo) -> dict[str, Any] | None:
    """The best evaluation so far: the restored checkpoint's, or checkpoints/best's record when that is
    better (rank 0 reads it, every rank gets the answer)."""
    on_disk = best_on_disk(root, metric) if info.is_main else None
    if on_disk is not None and is_better(on_disk["value"], best):
        best = on_disk
    return dist_.broadcast_object(best, info)


def best_on_disk(root: Path, metric: str) -> dict[str, Any] | None:
    """checkpoints/best's record ({"metric", "value", "step"}), or None. It can be newer than the step
    checkpoint a run resumes from (an evaluation after the last periodic save)."""
    try:
        record = ckpt.read_json(root / ckpt.BEST / "eval.json")
        value = float(record[metric])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not math.isfinite(value):
        return None
    return {"metric": metric, "value": value, "step": int(record.get("step", 0))}


def logged_at_resume(records: list[dict[str, Any]], step: int) -> tuple[dict[str, Any], float | None]:
    """(evaluation, training loss) already logged at the step training resumes from (the logger keeps the
    records up to it), so that resuming a run that had finished neither evaluates its last step and logs
    it again nor reports a final loss of nan."""
    evaluation: dict[str, Any] = {}
    loss = None
    for record in reversed(records):
        if record.get("step") != step:
            break
        # float(): metrics.jsonl writes a non-finite value as the string "nan"/"inf" (JSON has none)
        metrics = {k[len("eval/"):]: float(v) for k, v in record.items() if k.startswith("eval/")}
        evaluation = {**metrics, "_step": step} if metrics and not evaluation else evaluation
        loss = float(record["loss"]) if loss is None and "loss" in record else loss
    return evaluation, loss


def _differs(saved: Any, now: Any) -> bool:
    """A saved setting differs from this run's (a saved list equals the tuple it was written from)."""
    if isinstance(saved, (list, tuple)) and isinstance(now, (list, tuple)):
        return list(saved) != list(now)
    return saved != now


def changed_settings(saved: dict[str, Any], saved_world: int, cfg: TrainConfig,
                     world: int) -> dict[str, tuple[Any, Any]]:
    """{setting: (saved, now)} of the settings a resume changed that make its continuation inexact."""
    changed = {k: (v, getattr(cfg, k)) for k, v in saved.items()
               if k in NOTED_CHANGES and _differs(v, getattr(cfg, k))}
    if saved.get("grad_accum", cfg.grad_accum) * saved_world != cfg.grad_accum * world:
        changed["micro-batches per update"] = (saved.get("grad_accum", 0) * saved_world,
                                               cfg.grad_accum * world)
    return changed


def restore(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, optimizer_impl: str,
            precision: Precision, cfg: TrainConfig, info: dist_.DistInfo) -> TrainState:
    """Load weights, optimizer, scaler and RNG states from a training checkpoint folder into the given parts;
    the run's state there, returned as a value."""
    model_state, saved = ckpt.read_checkpoint(folder)
    check_state_fits(model, model_state, str(folder))
    ckpt.check_same_architecture(model, folder)
    try:
        dist_.load_full_state(model, optimizer, model_state, saved.get("optimizer"))
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{folder}: optimizer state does not fit this model/optimizer ({e})") from None
    # load_state_dict replaced the groups' settings with the saved ones (the loop, for checkpoints written
    # before optimizer_impl existed): run what this config chose, with this config's AdamW settings (a
    # resumed run's command line overrides what it names; the note at fit() lists what changed)
    set_impl(optimizer, optimizer_impl)
    for group in optimizer.param_groups:
        group["betas"], group["eps"] = tuple(cfg.betas), cfg.eps
        if group.get("name") == "decay":
            group["weight_decay"] = cfg.weight_decay
    precision.load_state_dict(saved.get("scaler") or {})
    state = TrainState.from_saved(saved, folder)
    rngs = saved.get("rng") or []
    if len(rngs) == info.world_size:
        set_rng_state(rngs[info.rank])
    else:  # another world size: exact RNG continuation is impossible; stay deterministic at least
        seed_everything(cfg.seed + info.rank + 1_000_003 * state.step)
    return state


__all__ = ["Start", "best_after_resume", "best_on_disk", "changed_settings", "check_fresh",
           "logged_at_resume", "repair", "restore"]
