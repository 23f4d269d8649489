"""What a training run has done so far: the Trainer's one piece of mutable progress, which a checkpoint
carries (beside the weights, optimizer, scaler and RNG states) and restores as a value."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any


@dataclass
class Counters:
    """Events of a run, logged in a step's record when not zero and reported in the summary."""

    skipped: int = 0  # updates dropped by nan_policy=skip
    rollbacks: int = 0  # returns to the newest checkpoint under nan_policy=rollback
    truncated: int = 0  # batch tensors cut to the model's context
    scaler_skips: int = 0  # fp16 steps the GradScaler skipped (overflow)

    def nonzero(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if v}


@dataclass
class TrainState:
    step: int = 0  # completed optimizer updates
    lr_scale: float = 1.0  # multiplied by rollback_lr_factor at every rollback
    counters: Counters = field(default_factory=Counters)
    tokens_seen: int = 0
    best: dict[str, Any] | None = None  # {"metric", "value", "step"} of checkpoints/best
    last_checkpoint: Path | None = None  # the newest periodic checkpoint written or restored
    resumed_config: dict[str, Any] = field(default_factory=dict)  # the train config a restored checkpoint ran
    resumed_world: int = 1  # ... and its number of processes

    def saved(self) -> dict[str, Any]:
        """The part of a checkpoint's train_state.pt this state writes."""
        return {"step": self.step, "lr_scale": self.lr_scale,
                "counters": {**asdict(self.counters), "tokens_seen": self.tokens_seen}, "best": self.best}

    @classmethod
    def from_saved(cls, state: dict[str, Any], folder: Path) -> TrainState:
        """The state a checkpoint's train_state.pt (read from `folder`) holds."""
        counters = state.get("counters", {})
        return cls(step=int(state["step"]), lr_scale=float(state.get("lr_scale", 1.0)),
                   counters=Counters(**{f.name: int(counters.get(f.name, 0)) for f in fields(Counters)}),
                   tokens_seen=int(counters.get("tokens_seen", 0)), best=state.get("best"),
                   last_checkpoint=folder, resumed_config=dict(state.get("train_config") or {}),
                   resumed_world=int(state.get("world_size", 1)))
