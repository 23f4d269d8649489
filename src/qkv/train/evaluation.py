"""Evaluation during Trainer.fit(): the task's eval_fn (or the held-out loss of max_eval_batches "val"
batches), run without disturbing training, and the best checkpoint it selects. A mixin of Trainer."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from qkv.config import ConfigError
from qkv.train import checkpoint as ckpt
from qkv.train import distributed as dist_
from qkv.train.batches import loss_and_count, to_device, truncate_batch
from qkv.train.rng import rng_state, set_rng_state


class Evaluation:
    """evaluate(), the held-out loss, and checkpoints/best. Uses the Trainer's cfg, model, data, eval_fn,
    dist, device, precision, callbacks, logger, best, step and save_checkpoint."""

    def _best_rule(self, data: Any) -> tuple[str, str]:
        """(metric, "min"|"max") that selects checkpoints/best: the config's, else the task's primary one."""
        cfg = self.cfg
        goals: dict[str, str] = {"loss": "min"}  # the held-out loss of max_eval_batches
        if self.eval_fn is not None:
            goals = dict(getattr(data, "metrics", None) or {}) or {"loss": "min"}
        metric = cfg.best_metric or next(iter(goals))
        mode = cfg.best_mode or goals.get(metric) or ("min" if metric == "loss" else None)
        if mode is None and self._eval_enabled():
            raise ConfigError(f"train.best_mode (min or max) must be given for best_metric {metric!r}: the "
                              f"task declares directions only for {sorted(goals)}")
        return metric, mode or "min"

    def _eval_enabled(self) -> bool:
        return self.eval_fn is not None or bool(self.cfg.max_eval_batches)

    def evaluate(self) -> dict[str, float]:
        """Run eval_fn (or the held-out loss) without disturbing training: eval mode, no_grad, autocast,
        and the RNG state restored afterwards (so evaluating never changes the training trajectory)."""
        saved_rng = rng_state()
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self.precision.autocast(), dist_.unsharded(self.model, self.dist):
                if self.eval_fn is not None:
                    metrics = self.eval_fn(self.model, **self._eval_kwargs())
                else:
                    metrics = self._heldout_loss()
        finally:
            self.model.train(was_training)
            set_rng_state(saved_rng)
        metrics = {k: float(v) for k, v in dict(metrics).items()}
        return dist_.broadcast_object(metrics, self.dist)  # every rank acts on rank 0's numbers

    def _eval_kwargs(self) -> dict[str, Any]:
        """max_eval_batches for an eval_fn with a parameter of that name (when set): one knob bounds both."""
        try:
            named = "max_eval_batches" in inspect.signature(self.eval_fn).parameters
        except (TypeError, ValueError):  # a builtin or C callable without a signature
            named = False
        if not named or self.cfg.max_eval_batches is None:
            return {}
        return {"max_eval_batches": self.cfg.max_eval_batches}

    def _heldout_loss(self) -> dict[str, float]:
        """Token-weighted loss over the first max_eval_batches "val" batches (global: rank r takes r, r + W,
        ...). Every rank runs the same number of forwards -- FSDP's forward is collective -- so a rank
        without a batch in the last round repeats one and gives it weight 0."""
        cfg, info = self.cfg, self.dist
        n = int(cfg.max_eval_batches or 0)
        stats = torch.zeros(2, dtype=torch.float64, device=self.device)
        for j in range(math.ceil(n / info.world_size)):
            i = j * info.world_size + info.rank
            batch = self.data.batch(i if i < n else info.rank % n, cfg.batch_size, "val")
            batch = to_device(truncate_batch(batch, self.context_length)[0], self.device)
            out_loss, count = loss_and_count(self.model(**batch), batch)
            weight = 1.0 if i < n else 0.0
            stats[0] += out_loss.double() * float(count) * weight
            stats[1] += count * weight
        dist_.all_reduce_sum(stats, info)
        if float(stats[1]) == 0:  # no target in the batches: no loss to report (never a fake 0.0)
            return {"loss": float("nan")}
        return {"loss": float(stats[0] / stats[1])}

    def _run_eval(self) -> dict[str, float]:
        metrics = self.evaluate()
        self.last_eval = {**metrics, "_step": self.step}
        for cb in self.callbacks:
            cb.on_eval(self, self.step, metrics)
        if self.logger is not None:
            self.logger.info(
                f"step {self.step}: eval " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())
            )
            if self.cfg.eval_every == 0 or self.step % self.cfg.eval_every:
                self.logger.log({"step": self.step, **{f"eval/{k}": v for k, v in metrics.items()}})
        if self.best_metric not in metrics:
            self.save_checkpoint()  # keep the steps done so far: fix the setting and --resume
            raise ConfigError(f"train.best_metric {self.best_metric!r} is not among the evaluation's metrics "
                              f"{sorted(metrics)} (step {self.step}; checkpoint saved)")
        value = metrics[self.best_metric]
        if math.isfinite(value):
            if self._is_better(value, self.state.best):
                previous, self.state.best = (self.state.best,
                                       {"metric": self.best_metric, "value": value, "step": self.step})
                if self.save_checkpoint(self.ckpt_root / ckpt.BEST,
                                        extra={"eval.json": {**metrics, "step": self.step}}) is None:
                    self.state.best = previous  # a non-finite state is no best
        return metrics

    def _is_better(self, value: float, than: dict[str, Any] | None) -> bool:
        return than is None or (value < than["value"] if self.best_mode == "min" else value > than["value"])

