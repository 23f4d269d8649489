"""What the training loop does with a non-finite loss or gradient (train.nan_policy): skip the update, roll
back to the newest checkpoint with a lower learning rate, or stop with the evidence saved."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from qkv.train import checkpoint as ckpt
from qkv.train.stability import NonFiniteError, nonfinite_grads, report


def nonfinite_step(trainer: Any, step: int, loss: float, grad_norm: float,
                   batches: list[dict[str, Any]]) -> None:
    """A non-finite loss or gradient at update `step`, by train.nan_policy: skip the update, roll back to the
    newest checkpoint with a lower LR, or stop (the default, and when the limits are spent) with the state
    before the bad update saved, the batches written beside it and a NonFiniteError naming the layers."""
    cfg, log = trainer.cfg, trainer.logger
    assert log is not None
    layers = nonfinite_grads(trainer.model)
    trainer.optimizer.zero_grad(set_to_none=True)
    if trainer.precision.scaler is not None:
        trainer.precision.scaler.update()  # close this iteration's unscale_ bookkeeping
    policy = cfg.nan_policy
    state, counters = trainer.state, trainer.state.counters
    if policy == "skip" and (cfg.max_skips is None or counters.skipped < cfg.max_skips):
        counters.skipped += 1
        state.step = step  # the update slot (and its data) is consumed
        log.info(f"step {step}: non-finite loss/gradient (loss={loss:.4g}, grad_norm={grad_norm:.4g}); "
                 f"update skipped ({counters.skipped} so far); layers: {', '.join(layers[:5])}")
        log.log({"step": step, "loss": loss, "grad_norm": grad_norm, "lr": trainer.lr_for(step),
                 "skipped": counters.skipped})
        return
    if policy == "rollback" and counters.rollbacks < cfg.max_rollbacks:
        path = ckpt.latest_checkpoint(trainer.ckpt_root)
        if path is not None:
            # the counters (but the GradScaler's) and the best so far outlive the rollback: checkpoints/best
            # holds the best even if it came after `path`, and forgetting it would let a worse evaluation of
            # the replayed steps overwrite it
            kept = replace(counters, rollbacks=counters.rollbacks + 1)
            trainer.load_checkpoint(path)
            restored = trainer.state
            kept.scaler_skips = restored.counters.scaler_skips
            restored.counters, restored.best = kept, state.best
            restored.lr_scale = state.lr_scale * cfg.rollback_lr_factor
            log.rewind(restored.step)  # the records after the restored step describe an abandoned path
            log.info(f"step {step}: non-finite loss/gradient (loss={loss:.4g}, "
                     f"grad_norm={grad_norm:.4g}) in {', '.join(layers[:5])}; rolled back to {path.name} "
                     f"(step {restored.step}), LR x{restored.lr_scale:.3g} (rollback "
                     f"{kept.rollbacks}/{cfg.max_rollbacks})")
            return
    # stop (or skip/rollback limits exhausted): keep the evidence, then report. The state saved is the one
    # before the bad update; it is never pruned against, and not written at all if an earlier update
    # already left non-finite weights (lr=inf): a non-finite state must not displace a good checkpoint
    saved = trainer.save_checkpoint(prune=False)
    batch_path = None
    if trainer.dist.is_main:
        batch_path = trainer.out_dir / f"nonfinite_batch_step{step}.pt"
        torch.save([{k: (v.detach().cpu() if isinstance(v, Tensor) else v) for k, v in b.items()}
                    for b in batches], batch_path)
    what = policy if policy == "stop" else f"{policy}, limit reached"
    newest = ckpt.latest_checkpoint(trainer.ckpt_root) if saved is None else None
    msg = report(step, loss, grad_norm, layers, saved, batch_path, what, newest_good=newest)
    log.info(msg)
    raise NonFiniteError(msg, step=step, loss=loss, grad_norm=grad_norm, layers=layers,
                         checkpoint=saved, batch_path=batch_path)
