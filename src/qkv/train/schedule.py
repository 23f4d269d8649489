"""Learning-rate schedules as pure functions of the update number (1-based).

The LR is recomputed from the step at every update, so resuming needs no scheduler state beyond the
step and the rollback multiplier. `step` counts updates: the first optimizer step uses lr_at(1).

- noam (Vaswani et al. 2017, eq. 3): factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5),
  with `factor` = TrainConfig.lr (The Annotated Transformer uses factor 1 or 2) and d_model from the
  model's config. It peaks at step == warmup with factor * (d_model * warmup)^-0.5.
- inverse_sqrt: linear warmup to lr, then lr * sqrt(warmup / step) (the seeds' LambdaLR recipe).
- cosine: linear warmup to lr, then a half cosine from lr (at update warmup + 1) towards min_lr, which it
  would reach one update after the last (max_steps + 1): no update runs at min_lr (0 by default), as in
  transformers' get_cosine_schedule_with_warmup and nanoGPT, whose steps count from 0.
- linear: the same with a straight line down.
- constant: linear warmup to lr (if warmup > 0), then lr. With warmup 0: the no-warmup ablation.
"""

from __future__ import annotations

import math

from qkv.config import ConfigError

SCHEDULES = ("noam", "inverse_sqrt", "cosine", "linear", "constant")


def noam(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    step = max(step, 1)
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def lr_at(step: int, *, schedule: str, lr: float, warmup: int, max_steps: int, min_lr: float = 0.0,
          d_model: int | None = None) -> float:
    """The learning rate of update number `step` (1-based)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown schedule {schedule!r}; choose one of {list(SCHEDULES)}")
    step = max(step, 1)
    if schedule == "noam":
        if d_model is None:
            raise ConfigError("schedule=noam needs the model's d_model (model.config.d_model)")
        if warmup < 1:
            raise ConfigError("schedule=noam needs warmup >= 1 step")
        return noam(step, d_model, warmup, lr)
    if warmup > 0 and step <= warmup:
        return lr * step / warmup  # linear warmup: lr/warmup at step 1, lr at step == warmup
    if schedule == "constant":
        return lr
    if schedule == "inverse_sqrt":
        return lr * math.sqrt(max(warmup, 1) / step)
    progress = min(1.0, (step - 1 - warmup) / max(1, max_steps - warmup))
    if schedule == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    return lr - (lr - min_lr) * progress  # linear
