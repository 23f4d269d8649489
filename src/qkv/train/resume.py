"""Where Trainer.fit() starts, and what a checkpoint restores: the repair of what a killed process left,
resume (train.resume / --resume), "fit again" on the same trainer, and the train-state round trip.

A run starts fresh only in an empty checkpoints folder: a fresh run's pruning would keep an older run's
higher steps and delete its own, so checkpoints of another run are an error rather than silently mixed.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkv.checkpoint import CheckpointError
from qkv.config import ConfigError, to_dict
from qkv.train import checkpoint as ckpt
from qkv.train import distributed as dist_
from qkv.train.optim import set_impl
from qkv.train.rng import seed_everything, set_rng_state

if TYPE_CHECKING:
    from qkv.train.config import TrainConfig
    from qkv.train.trainer import Trainer

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


def start(trainer: Trainer) -> Start:
    """Repair the checkpoints folder, then resume from its newest checkpoint (train.resume, or fit() again on
    a trainer whose newest checkpoint is its own), or check it is empty and seed a fresh run."""
    info, root = trainer.dist, trainer.ckpt_root
    begin = Start()
    if info.is_main:  # before anything is read or written: repair what a killed process left
        begin.repaired = ckpt.clean_stale(root)
    dist_.barrier(info)
    path = ckpt.latest_checkpoint(root)
    # fit() again on this trainer (after Ctrl-C in a notebook, or to see the summary again): the newest
    # checkpoint is its own, so continue from it as a resume would
    again = trainer.step > 0 and path is not None and path == trainer.last_checkpoint
    if trainer.resume or again:
        if path is not None:
            trainer.load_checkpoint(path)
            begin.resumed_from = path
            on_disk = best_on_disk(root, trainer.best_metric) if info.is_main else None
            if on_disk is not None and trainer._is_better(on_disk["value"], trainer.best):
                trainer.best = on_disk
            trainer.best = dist_.broadcast_object(trainer.best, info)  # rank 0 read checkpoints/best
        else:
            begin.fresh_note = f"resume=True but {root} holds no checkpoint: starting fresh"
            warnings.warn(begin.fresh_note, stacklevel=3)
    if begin.resumed_from is None:
        existing = ckpt.list_checkpoints(root)
        if existing:
            raise ConfigError(
                f"{root} already holds checkpoints of another run (up to step "
                f"{existing[-1][0]}): resume=True continues it; a new run needs another out_dir"
            )
        seed_everything(trainer.cfg.seed + info.rank)
    return begin


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


def train_state(trainer: Trainer) -> dict[str, Any]:
    """The counters, scaler and settings a checkpoint carries beside the weights and optimizer."""
    t = trainer
    return {
        "format": 1, "step": t.step, "lr_scale": t.lr_scale, "world_size": t.dist.world_size,
        "scaler": t.precision.state_dict(),
        "counters": {"skipped": t.skipped, "scaler_skips": t.scaler_skips, "rollbacks": t.rollbacks,
                     "truncated": t.truncated, "tokens_seen": t.tokens_seen},
        "best": t.best, "train_config": to_dict(t.cfg),
    }


def restore(trainer: Trainer, folder: Path) -> None:
    """Restore weights, optimizer, counters and RNG states from a training checkpoint folder."""
    t = trainer
    model_state, state = ckpt.read_checkpoint(folder)
    ckpt.check_model_state(t.model, model_state, str(folder))
    ckpt.check_same_architecture(t.model, folder)
    try:
        dist_.load_full_state(t.model, t.optimizer, model_state, state.get("optimizer"))
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{folder}: optimizer state does not fit this model/optimizer ({e})") from None
    # load_state_dict replaced the groups' settings with the saved ones (the loop, for checkpoints written
    # before optimizer_impl existed): run what this config chose, with this config's AdamW settings (a
    # resumed run's command line overrides what it names; the note at fit() lists what changed)
    set_impl(t.optimizer, t.optimizer_impl)
    for group in t.optimizer.param_groups:
        group["betas"], group["eps"] = tuple(t.cfg.betas), t.cfg.eps
        if group.get("name") == "decay":
            group["weight_decay"] = t.cfg.weight_decay
    t.step = int(state["step"])
    t.lr_scale = float(state.get("lr_scale", 1.0))
    t.precision.load_state_dict(state.get("scaler") or {})
    counters = state.get("counters", {})
    t.skipped = int(counters.get("skipped", 0))
    t.scaler_skips = int(counters.get("scaler_skips", 0))
    t.rollbacks = int(counters.get("rollbacks", 0))
    t.truncated = int(counters.get("truncated", 0))
    t.tokens_seen = int(counters.get("tokens_seen", 0))
    t.best = state.get("best")
    t.last_checkpoint = folder
    t._resumed_config = dict(state.get("train_config") or {})
    t._resumed_world = int(state.get("world_size", 1))
    rngs = state.get("rng") or []
    if len(rngs) == t.dist.world_size:
        set_rng_state(rngs[t.dist.rank])
    else:  # another world size: exact RNG continuation is impossible; stay deterministic at least
        seed_everything(t.cfg.seed + t.dist.rank + 1_000_003 * t.step)


__all__ = ["Start", "best_on_disk", "changed_settings", "logged_at_resume", "restore", "start", "train_state"]
