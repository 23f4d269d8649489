"""The one training loop. It knows no model family and no task: it receives a model whose forward
takes a batch's keys and returns ModelOutput(loss, n_targets), a batch source, and optional callables.

One update (nanoGPT's order, made token-exact):
    for each of grad_accum micro-batches (gradient sync only on the last):
        batch = data.batch(global_index, batch_size, "train") -> truncate to context -> device
        with autocast: out = model(**batch)
        backward(out.loss * out.n_targets * c)              # c = 1 / (batch_size * grad_accum), a constant
    grads *= world_size / (c * N)  where N = target tokens of all micro-batches on all ranks
        -> exactly the gradient of (sum of per-token losses) / N, i.e. one big batch (HF #34191, nanoGPT #168)
    unscale (fp16) -> callbacks -> pre-clip global norm -> non-finite guard -> clip -> AdamW step
"""

from __future__ import annotations

import gc
import math
import signal
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from qkv.config import ConfigError, from_dict, to_dict
from qkv.nn.block import Block
from qkv.nn.moe import moe_layers, moe_max_violation
from qkv.nn.params import count_parameters
from qkv.train import checkpoint as ckpt
from qkv.train import distributed as dist_
from qkv.train import resume as resume_
from qkv.train.batches import LengthTruncationWarning, count_tokens, loss_and_count, to_device, truncate_batch
from qkv.train.callbacks import Callback
from qkv.train.config import TrainConfig
from qkv.train.evaluation import Evaluation
from qkv.train.logging import RunLogger
from qkv.train.nonfinite import nonfinite_step
from qkv.train.optim import build_optimizer, implementation
from qkv.train.precision import Precision, resolve_device
from qkv.train.rng import rng_state, seed_everything
from qkv.train.schedule import lr_at
from qkv.train.signals import SignalStop, TrainingInterrupted
from qkv.train.stability import NonFiniteError, layer_norms
from qkv.train.state import TrainState


class BatchSource(Protocol):
    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, Tensor]: ...


EvalFn = Callable[[nn.Module], dict[str, float]]


class Trainer(Evaluation, SignalStop):
    """Trainer(model, cfg, data, eval_fn=None, callbacks=(), resume=None).fit() -> summary dict.

    model: an nn.Module (normally a qkv model) whose forward(**batch) returns an object with `.loss`
      (mean over targets) and `.n_targets` (else the batch's rows weigh it), a {"loss": ...} mapping, or the
      scalar loss itself; `model.config.d_model` feeds the Noam schedule and
      `model.config.context_length` the length truncation, when present.
    cfg: TrainConfig, or a mapping checked by qkv.config.from_dict.
    data: a batch source, `data.batch(index, batch_size, split) -> dict of tensors` (model kwargs). It must be
      a pure function of its arguments (a random one seeded by them, as the tasks' are): an exact resume asks
      for batch `index` again instead of restoring a sampler's state, and under DDP/FSDP each rank asks for
      its own indices, so a source that keeps state between calls resumes on other data and may feed ranks the
      same.
    eval_fn: called as eval_fn(model) (plus max_eval_batches=, if it names that parameter) in eval mode
      under no_grad (and autocast) every eval_every steps and at the end; returns {metric: value}, logged as
      `eval/<metric>`. Without one, and with cfg.max_eval_batches > 0, the held-out loss over that many "val"
      batches is used.
    resume: continue from out_dir/checkpoints' newest checkpoint (default: cfg.resume).

    The best checkpoint (checkpoints/best) follows cfg.best_metric, by default the primary metric the task
    declares (`data.metrics`, first entry, with its direction); a metric the evaluation does not report is a
    ConfigError at the first evaluation. SIGINT/SIGTERM during fit() finish the current step, checkpoint it
    and raise TrainingInterrupted (a second signal stops at once).
    """

    def __init__(self, model: nn.Module, cfg: TrainConfig | dict[str, Any], data: BatchSource,
                 eval_fn: EvalFn | None = None, callbacks: list[Callback] | tuple[Callback, ...] = (),
                 *, resume: bool | None = None) -> None:
        if isinstance(cfg, dict):
            cfg = from_dict(TrainConfig, cfg)
        if not isinstance(cfg, TrainConfig):
            raise TypeError(f"cfg must be a TrainConfig or a mapping, got {type(cfg).__name__}")
        cfg.validate()
        if not callable(getattr(data, "batch", None)):
            raise TypeError("data must be a batch source with batch(index, batch_size, split) -> dict of "
                            "tensors")
        self.cfg = cfg
        self.data = data
        self.eval_fn = eval_fn
        for note in cfg.misleading(evaluates=self._eval_enabled()):
            warnings.warn(note, stacklevel=2)
        self.callbacks = list(callbacks)
        self.resume = cfg.resume if resume is None else resume
        self.out_dir = Path(cfg.out_dir)
        self.ckpt_root = self.out_dir / "checkpoints"

        self.state = TrainState()  # what checkpoints carry and restore
        self.should_stop = False
        self.last_eval: dict[str, float] = {}
        self.last_loss = float("nan")
        # the model's auxiliary loss, mean over the last update's batches
        self.last_aux_loss: float | None = None
        self.last_maxvio: float | None = None  # MoE routing's max load / mean load - 1 over the last update
        self._signal: int | None = None  # SIGINT/SIGTERM received during fit()
        self._signal_agreed = False  # under DDP/FSDP: some rank received one (all-reduced with the loss)
        self._old_handlers: dict[int, Any] = {}

        # -- device, distributed, precision ----------------------------------------------------------------
        device = resolve_device(cfg.device)
        self.dist, self.device = dist_.setup(cfg.distributed, device)
        self.precision = Precision(cfg.precision, self.device)
        mcfg = getattr(model, "config", None)
        self.d_model = getattr(mcfg, "d_model", None)
        self.context_length = getattr(mcfg, "context_length", None)
        if cfg.schedule == "noam" and self.d_model is None:
            raise ConfigError("schedule=noam needs model.config.d_model; this model has none")

        model.to(self.device)
        if cfg.grad_checkpointing:
            if not hasattr(model, "set_gradient_checkpointing"):
                raise ConfigError(f"grad_checkpointing=true but {type(model).__name__} has no "
                                  "set_gradient_checkpointing()")
            model.set_gradient_checkpointing(True)
        self._routes = bool(moe_layers(model))  # a dense model skips the routing-balance reading per step
        self.model = model  # the module itself: FSDP2 shards it in place; DDP/compile wrap it in `engine`

        # -- wrapping order: FSDP shards in place before the optimizer sees the (sharded) parameters; the
        #    compiled module goes inside DDP (nanoGPT's order) ----------------------------------------------

        if self.dist.mode == "fsdp":
            dist_.wrap(model, self.dist, block_types=(Block,))
        self.optimizer, self.group_summary = build_optimizer(model, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                                             weight_decay=cfg.weight_decay,
                                                             impl=cfg.optimizer_impl)
        self.optimizer_impl = implementation(self.optimizer)  # kept across load_checkpoint (which resets it)
        # every parameter that can have a gradient, listed once (the optimizer's, after any FSDP sharding)
        # instead of walking model.parameters() (~0.1 ms for a 6-layer GPT) twice per step
        self._trainable = [p for g in self.optimizer.param_groups for p in g["params"]]
        engine: nn.Module = torch.compile(model) if cfg.compile else model
        if self.dist.mode == "ddp":
            engine = dist_.wrap(engine, self.dist, block_types=(Block,), find_unused=cfg.ddp_find_unused)
        self.engine = engine
        self.logger: RunLogger | None = None
        self.best_metric, self.best_mode = self._best_rule(data)

    # -- read-only views of the state, for callbacks and callers --------------------------------------------
    @property
    def step(self) -> int:
        return self.state.step

    @property
    def last_checkpoint(self) -> Path | None:
        return self.state.last_checkpoint

    # ---------------------------------------------------------------------------------------------------
    def lr_for(self, step: int) -> float:
        c = self.cfg
        return self.state.lr_scale * lr_at(step, schedule=c.schedule, lr=c.lr, warmup=c.warmup_steps(),
                                     max_steps=c.max_steps, min_lr=c.min_lr, d_model=self.d_model)

    def _set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def _prepare(self, batch: dict[str, Any], step: int, micro: int) -> dict[str, Any]:
        if not isinstance(batch, dict):
            raise TypeError(f"the batch source returned {type(batch).__name__}; expected a dict of model "
                            "kwargs")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", LengthTruncationWarning)
            batch, n_cut = truncate_batch(batch, self.context_length)
        if n_cut:
            if self.state.counters.truncated == 0 and self.logger is not None:
                self.logger.info(f"step {step}: {caught[0].message} (counted in metrics as 'truncated')")
            self.state.counters.truncated += n_cut
            for w in caught[:1]:
                warnings.warn(w.message, LengthTruncationWarning, stacklevel=3)
        batch = to_device(batch, self.device)
        for cb in self.callbacks:
            changed = cb.on_batch(self, step, micro, batch)
            batch = batch if changed is None else changed  # None: changed in place, or not at all
        return batch

    def compute_gradients(self, step: int) -> tuple[float, int, int, list[dict[str, Any]]]:
        """Forward/backward over update `step`'s micro-batches; leaves token-normalised gradients in
        .grad (unscaled under fp16). Returns (mean loss per target token, targets, tokens, micro-batches)."""
        cfg, info = self.cfg, self.dist
        ga, world = cfg.grad_accum, info.world_size
        c = 1.0 / (cfg.batch_size * ga)  # keeps the backward's magnitude near a mean loss's; undone below
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        n_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = 0
        batches = []
        aux_sum = None
        for micro in range(ga):
            index = ((step - 1) * ga + micro) * world + info.rank
            batch = self._prepare(self.data.batch(index, cfg.batch_size, "train"), step, micro)
            batches.append(batch)
            tokens += count_tokens(batch)
            with dist_.sync_context(self.engine, info, sync=micro == ga - 1):
                with self.precision.autocast():
                    out = self.engine(**batch)
                out_loss, n = loss_and_count(out, batch)
                aux = getattr(out, "aux_loss", None)  # an auxiliary loss the model reports (MoE balancing)
                if aux is not None:
                    aux_sum = aux.detach().double() + (0.0 if aux_sum is None else aux_sum)
                n = torch.as_tensor(n, device=out_loss.device).to(torch.float32)
                self.precision.scale(out_loss.float() * n * c).backward()
            loss_sum += out_loss.detach().double() * n.double()
            n_sum += n.double()
        # a signal on any rank stops every rank after this step
        flag = 1.0 if self._signal is not None else 0.0
        stats = torch.cat([torch.stack([loss_sum, n_sum]),
                           torch.tensor([float(tokens), flag], dtype=torch.float64, device=self.device)])
        dist_.all_reduce_sum(stats, info)
        loss_total, n_total, tokens_total, flags = (float(x) for x in stats.tolist())
        self._signal_agreed = self._signal_agreed or flags > 0
        self.precision.unscale_(self.optimizer)
        # DDP/FSDP average gradients over ranks: grads = (c / W) * sum over all micro-batches of n_i *
        # grad(loss_i)
        factor = world / (c * n_total) if n_total > 0 else 0.0
        self._scale_grads(factor)
        loss = loss_total / n_total if n_total > 0 else float("nan")
        self.last_aux_loss = float(aux_sum) / ga if aux_sum is not None else None
        self.last_maxvio = moe_max_violation(self.model) if self._routes else None
        return loss, int(n_total), int(tokens_total), batches

    def _grad_norm(self) -> float:
        grads = [p.grad for p in self._trainable if p.grad is not None]
        if not grads:
            return 0.0
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=None)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor partial norm, reduced over ranks
            norm = norm.full_tensor()
        return float(norm)

    def _clip(self, norm: float) -> None:
        if self.cfg.clip_grad is not None and norm > self.cfg.clip_grad:
            coef = self.cfg.clip_grad / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s formula
            self._scale_grads(coef)

    def _scale_grads(self, factor: float) -> None:
        """grad *= factor for every gradient, as one multi-tensor op (what torch's own clip_grad_norm_ calls):
        the same products as a mul_ per tensor, without a Python loop of one small kernel per parameter."""
        grads = [p.grad for p in self._trainable if p.grad is not None]
        if grads:
            with torch.no_grad():
                torch._foreach_mul_(grads, factor)

    # ---------------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to cfg.max_steps (or a stop) and return the summary; resumes as train.resume says."""
        cfg, info = self.cfg, self.dist
        t_start = time.perf_counter()
        self.should_stop = False
        begin = self.begin()
        self.logger = RunLogger(self.out_dir, enabled=info.is_main, progress=cfg.progress,
                                tensorboard=cfg.tensorboard, total_steps=cfg.max_steps, start_step=self.step)
        log = self.logger
        # rank 0 holds the log; every rank must agree on whether to evaluate
        if begin.resumed_from is not None:
            logged = resume_.logged_at_resume(self.logger.records, self.step)
            self.last_eval, loss = dist_.broadcast_object(logged, info)
            self.last_loss = loss if loss is not None else self.last_loss
        self._install_signal_handlers()
        try:
            self._log_start(begin)
            if cfg.nan_policy == "rollback" and not ckpt.list_checkpoints(self.ckpt_root):
                self.save_checkpoint()  # rollback needs a good state to return to
            for cb in self.callbacks:
                cb.on_fit_start(self)
            self.model.train()
            self._loop()
            if not self._interrupted() and self._eval_enabled() and self.last_eval.get("_step") != self.step:
                self._run_eval()
            if self.last_checkpoint is None or not self.last_checkpoint.name.endswith(f"{self.step:08d}"):
                self.save_checkpoint()
            if self._interrupted(final=True):
                last = self.last_checkpoint
                here = last if last is not None and last.name.endswith(f"{self.step:08d}") else None
                raise TrainingInterrupted(self._signal or signal.SIGINT, self.step, here)
            summary = self.summary(time.perf_counter() - t_start)
            log.info(f"done: {self.step} steps, final loss {self.last_loss:.4f}"
                     + (f", best eval {self.state.best['metric']}={self.state.best['value']:.4f} at step "
                        f"{self.state.best['step']}"
                        if self.state.best else ""))
            for cb in self.callbacks:
                cb.on_fit_end(self, summary)
            return summary
        except NonFiniteError:
            raise  # it saved what it should (never a non-finite state)
        except Exception:
            self._save_after_error()
            raise
        finally:
            self._restore_signal_handlers()
            log.close(plot=self.cfg.plot)

    def _log_start(self, begin: resume_.Start) -> None:
        """The run's opening lines: repairs, the model and setup, and what a resume changed."""
        cfg, info, log = self.cfg, self.dist, self.logger
        assert log is not None
        for line in begin.repaired:
            log.info(f"checkpoints: {line} (left by an interrupted process)")
        if begin.fresh_note:
            log.info(begin.fresh_note)
        n_params = count_parameters(self.model)
        log.info(f"training {dist_.model_class_name(self.model)} ({n_params:,} parameters) on {self.device}, "
                 f"precision {self.precision.name}, distributed {info.mode} x{info.world_size}, "
                 f"global batch {cfg.batch_size * cfg.grad_accum * info.world_size} sequences")
        log.info(f"{self.group_summary.line()}; AdamW {self.optimizer_impl}")
        if begin.resumed_from is None:
            return
        log.info(f"resumed from {begin.resumed_from} at step {self.step}")
        changed = resume_.changed_settings(self.state.resumed_config, self.state.resumed_world, cfg,
                                           info.world_size)
        if changed:
            log.info("note: resumed with changed settings (saved -> now): " + ", ".join(
                f"{k} {a} -> {b}" for k, (a, b) in changed.items()) + "; the continuation is not exact")

    def _save_after_error(self) -> None:
        """An exception (eval_fn, a callback, the batch source) is leaving fit(): checkpoint the completed
        steps so a resume need not redo them. Best effort, never masking that exception, and single-process
        only: saving is collective under DDP/FSDP and the other ranks may be elsewhere."""
        saved = self.last_checkpoint == ckpt.step_dir(self.ckpt_root, self.step)
        if self.dist.enabled or self.step == 0 or saved:
            return
        try:
            path = self.save_checkpoint()
            if path is not None and self.logger is not None:
                self.logger.info(f"step {self.step}: stopped by an exception; checkpoint saved to {path}")
        except Exception:  # noqa: BLE001 - the original exception is the one to report
            pass

    def _loop(self) -> None:
        cfg, log = self.cfg, self.logger
        assert log is not None
        interval_time, interval_tokens = 0.0, 0
        while self.step < cfg.max_steps and not self.should_stop:
            if self._interrupted():
                name = signal.Signals(self._signal).name if self._signal else "a signal on another rank"
                log.info(f"received {name}: stopping after step {self.step} with a checkpoint")
                break
            step = self.step + 1
            t0 = time.perf_counter()
            for cb in self.callbacks:
                cb.on_step_start(self, step)
            lr = self.lr_for(step)
            self._set_lr(lr)
            loss, n_targets, tokens, batches = self.compute_gradients(step)
            for cb in self.callbacks:
                cb.on_after_backward(self, step)
            grad_norm = self._grad_norm()
            scaler_owns_grads = self.precision.scaler is not None
            if not math.isfinite(loss) or (not math.isfinite(grad_norm) and not scaler_owns_grads):
                if n_targets == 0 and math.isfinite(grad_norm):
                    log.info(f"step {step}: no target tokens in the batch; update skipped")
                    self.optimizer.zero_grad(set_to_none=True)
                    if self.precision.scaler is not None:
                        self.precision.scaler.update()
                    self.state.step = step
                    continue
                nonfinite_step(self, step, loss, grad_norm, batches)  # raises, or skips / rolls back
                continue
            if cfg.diag_every and step % cfg.diag_every == 0:
                log.diag(step, layer_norms(self.model))  # pre-clip grads, weights before this update
            self._clip(grad_norm)
            if scaler_owns_grads and not math.isfinite(grad_norm):
                self.state.counters.scaler_skips += 1
            self.precision.step(self.optimizer)
            after_update = getattr(self.model, "after_update", None)  # state a model moves per update (MoE)
            if after_update is not None:
                after_update()
            self.optimizer.zero_grad(set_to_none=True)
            self.state.step = step
            self.last_loss = loss
            self.state.tokens_seen += tokens
            dt = time.perf_counter() - t0
            interval_time += dt
            interval_tokens += tokens

            record: dict[str, Any] = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                                      "tokens_per_s": interval_tokens / max(interval_time, 1e-9),
                                      "step_time_s": dt, "tokens": self.state.tokens_seen,
                                      "targets": n_targets}
            if self.last_aux_loss is not None:
                record["aux_loss"] = self.last_aux_loss
            if self.last_maxvio is not None:
                record["moe_maxvio"] = self.last_maxvio
            record.update(self.state.counters.nonzero())
            if self.precision.scaler is not None:
                record["loss_scale"] = float(self.precision.scaler.get_scale())
            if cfg.eval_every and step % cfg.eval_every == 0 and self._eval_enabled():
                record.update({f"eval/{k}": v for k, v in self._run_eval().items() if not k.startswith("_")})
            logged = step % cfg.log_every == 0 or step == 1 or step == cfg.max_steps or self.should_stop \
                or any(k.startswith("eval/") for k in record)
            if logged:
                log.log(record)
                log.step_line(step, cfg.max_steps, loss, lr, record["tokens_per_s"])
                interval_time, interval_tokens = 0.0, 0
            log.progress(step, loss, lr, record["tokens_per_s"])
            if cfg.save_every and step % cfg.save_every == 0:
                self.save_checkpoint()
            for cb in self.callbacks:
                cb.on_step_end(self, step, record)
            if not logged and (self.should_stop or self._signal is not None or self._interrupted()):
                log.log(record)  # the last step of a stopped run: a resume reads its loss back from the log

    # ---------------------------------------------------------------------------------------------------
    def train_state(self) -> dict[str, Any]:
        """The counters, scaler and settings a checkpoint carries beside the weights and optimizer."""
        return {"format": 1, **self.state.saved(), "world_size": self.dist.world_size,
                "scaler": self.precision.state_dict(), "train_config": to_dict(self.cfg)}

    def save_checkpoint(self, folder: Path | None = None, extra: dict[str, Any] | None = None, *,
                        prune: bool = True) -> Path | None:
        """Checkpoint the current state (collective under DDP/FSDP: every rank calls; rank 0 writes).
        Default: the step folder, then prune to keep_last. Returns None, writing nothing, when the weights or
        optimizer moments are not finite: such a state must never replace or push out a good checkpoint."""
        periodic = folder is None
        folder = folder or ckpt.step_dir(self.ckpt_root, self.step)
        model_state, optim_state = dist_.full_state(self.model, self.optimizer)
        rngs = dist_.gather_objects(rng_state(), self.dist)
        written = False
        if self.dist.is_main:
            if ckpt.state_is_finite(model_state, optim_state):
                state = {**self.train_state(), "optimizer": optim_state, "rng": rngs}
                ckpt.write_checkpoint(folder, model_state, ckpt.model_meta(self.model), state, extra)
                if periodic and prune:
                    ckpt.prune(self.ckpt_root, self.cfg.keep_last)
                written = True
            elif self.logger is not None:
                self.logger.info(f"step {self.step}: weights or optimizer state are not finite; "
                                 f"{folder.name} not written")
        written = dist_.broadcast_object(written, self.dist)  # every rank returns the same answer
        if not written:
            return None
        if periodic:
            self.state.last_checkpoint = folder
        for cb in self.callbacks:
            cb.on_checkpoint(self, self.step, folder)
        return folder

    def load_checkpoint(self, folder: str | Path) -> None:
        """Restore weights, optimizer, counters and RNG states from a training checkpoint folder."""
        self.state = resume_.restore(Path(folder), self.model, self.optimizer, self.optimizer_impl,
                                     self.precision, self.cfg, self.dist)

    def begin(self) -> resume_.Start:
        """Where fit() starts: repair the checkpoints folder, then resume from its newest checkpoint
        (train.resume, or fit() again on a trainer whose newest checkpoint is its own), or check the folder
        is empty and seed a fresh run."""
        info, root = self.dist, self.ckpt_root
        begin = resume_.Start(repaired=resume_.repair(root, info))
        path = ckpt.latest_checkpoint(root)
        # fit() again (after Ctrl-C in a notebook, or to see the summary again): the newest checkpoint is
        # this trainer's own, so continue from it as a resume would
        again = self.step > 0 and path is not None and path == self.last_checkpoint
        if (self.resume or again) and path is not None:
            self.load_checkpoint(path)
            begin.resumed_from = path
            self.state.best = resume_.best_after_resume(root, self.state.best, self.best_metric,
                                                        self._is_better, info)
        elif self.resume:
            begin.fresh_note = f"resume=True but {root} holds no checkpoint: starting fresh"
            warnings.warn(begin.fresh_note, stacklevel=3)
        if begin.resumed_from is None:
            resume_.check_fresh(root)
            seed_everything(self.cfg.seed + info.rank)
        return begin

    def summary(self, elapsed: float) -> dict[str, Any]:
        return {"steps": self.step, "final_loss": self.last_loss, "best_eval": self.state.best,
                "eval": {k: v for k, v in self.last_eval.items() if not k.startswith("_")},
                **asdict(self.state.counters), "tokens": self.state.tokens_seen, "elapsed_s": elapsed,
                "out_dir": str(self.out_dir),
                "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
                "best_checkpoint": str(self.ckpt_root / ckpt.BEST) if self.state.best else None,
                "metrics": str(self.out_dir / "metrics.jsonl")}

    def close(self) -> None:
        """Tear down the process group this trainer initialised (call once at the end of a torchrun script, on
        every rank). The DDP wrapper is dropped first, while the group exists: freed after the group is
        destroyed (when the caller lets go of the trainer), its reducer's gloo work joined a thread that
        waited for the GIL the freeing thread held, and the process never exited (seen under torchrun, 4 runs
        in 9)."""
        if self.engine is not self.model and isinstance(self.engine, nn.parallel.DistributedDataParallel):
            self.engine = self.model
            gc.collect()
        dist_.teardown(self.dist)
