"""TrainConfig: every knob of the training loop, one strict dataclass.

Built with `qkv.config.from_dict(TrainConfig, mapping)` (YAML / CLI overrides): an unknown key is a
ConfigError naming the closest valid key, and `validate()` rejects inconsistent values in one sentence.
A `TrainConfig(...)` built directly gets the same type and choice checks from `validate()` (the Trainer
calls it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from qkv.config import ConfigError, check_fields, parse_overrides
from qkv.train.optim import OptimizerImpl

Schedule = Literal["noam", "inverse_sqrt", "cosine", "linear", "constant"]
Precision = Literal["auto", "fp32", "bf16", "fp16"]
NanPolicy = Literal["skip", "stop", "rollback"]
Distributed = Literal["auto", "none", "ddp", "fsdp"]


@dataclass
class TrainConfig:
    # -- length and batch ------------------------------------------------------------------------------
    max_steps: int = 1000  # optimizer updates
    batch_size: int = 32  # sequences per micro-batch per process
    grad_accum: int = 1  # micro-batches per update (token-normalised: exactly a bigger batch)
    # -- optimizer: AdamW (Loshchilov & Hutter 2019) -----------------------------------------------------
    lr: float = 3e-4  # peak LR; for schedule=noam this is the paper's "factor" (LR = factor * noam(step))
    min_lr: float = 0.0  # floor of the cosine/linear decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])  # the seeds: beta2 in 0.95..0.98
    eps: float = 1e-8  # the seeds: 1e-6..1e-8
    weight_decay: float = 0.1  # decoupled; never applied to norms, biases or embeddings
    # auto | fused | foreach | loop: torch's AdamW kernel; auto = fused where torch has it (CPU, CUDA),
    # else foreach. Same update to float rounding (qkv/train/optim.py)
    optimizer_impl: OptimizerImpl = "auto"
    # -- schedule ----------------------------------------------------------------------------------------
    schedule: Schedule = "cosine"  # noam | inverse_sqrt | cosine | linear | constant
    warmup: float = 0.02  # >= 1: steps; < 1: fraction of max_steps. 0 = no warmup (the ablation)
    # -- stability ---------------------------------------------------------------------------------------
    clip_grad: float | None = 1.0  # global-norm clipping threshold; null = off (the norm is still logged)
    nan_policy: NanPolicy = "stop"  # what a non-finite loss or gradient does: skip | stop | rollback
    rollback_lr_factor: float = 0.5  # rollback multiplies the LR by this each time
    max_rollbacks: int = 3  # rollbacks before giving up with NonFiniteError
    max_skips: int | None = 10  # skipped updates allowed before stopping (null = no limit): a run that keeps
    #                             producing NaNs is broken, and should end with an error, not a stale loss
    # -- numerics and speed ------------------------------------------------------------------------------
    # auto (bf16 on a GPU that has it, fp32 on a CPU: train/precision.py) | fp32 | bf16 (autocast, CPU+CUDA) |
    # fp16 (autocast + GradScaler, CUDA)
    precision: Precision = "auto"
    compile: bool = False  # torch.compile the model (checkpoints never carry `_orig_mod.`)
    grad_checkpointing: bool = False  # recompute each block's activations in backward (less memory)
    device: str = "auto"  # auto (cuda if available, else cpu) | cpu | cuda | cuda:N
    distributed: Distributed = "auto"  # auto (ddp under torchrun with >1 process) | none | ddp | fsdp
    ddp_find_unused: bool = False  # DDP: allow parameters that get no gradient (e.g. an unused pooler)
    # -- logging, evaluation, checkpoints ----------------------------------------------------------------
    log_every: int = 10  # steps between metrics.jsonl records (every step when 1)
    eval_every: int = 0  # steps between eval_fn calls (0 = only at the end)
    max_eval_batches: int | None = None  # held-out "val" batches for the loss when there is no eval_fn; an
    #                                      eval_fn with a `max_eval_batches` parameter receives it
    # steps between checkpoints (0 = only at the end). SIGINT/SIGTERM always save the current step; this
    # bounds what a hard kill (SIGKILL, OOM, power) loses: HF Trainer's default, minutes of CPU work for the
    # shipped configs, < 1% of the time in writes
    save_every: int = 500
    keep_last: int = 3  # newest periodic checkpoints kept, 0 = all (best-by-eval is kept separately)
    best_metric: str | None = None  # eval metric that selects checkpoints/best; null = the task's primary
    #                                 metric (task.metrics), or the held-out "loss" without a task evaluation
    best_mode: Literal["min", "max"] | None = None  # null = the metric's direction as the task declares it
    diag_every: int = 0  # steps between per-layer grad/weight norm records (0 = off)
    progress: bool = True  # tqdm progress bar (rank 0)
    tensorboard: bool = True  # TensorBoard event files when `tensorboard` is installed
    plot: bool = True  # curves.png (loss, LR, grad norm, eval metrics) at the end
    out_dir: str = "runs/default"
    resume: bool = False  # continue from out_dir's last checkpoint when there is one
    seed: int = 0  # python, numpy and torch RNGs (data order comes from the batch source's own seed)

    def validate(self) -> None:
        if isinstance(self.device, torch.device):  # TrainConfig(device=torch.device("cuda", 1)) from Python
            self.device = str(self.device)
        check_fields(self)  # types and choices, also for a TrainConfig(...) built directly in Python
        for name in ("lr", "min_lr", "eps", "weight_decay", "warmup", "rollback_lr_factor", "clip_grad"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ConfigError(f"TrainConfig.{name} must be a finite number, got {value}")
        if self.max_steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ConfigError("TrainConfig: max_steps, batch_size and grad_accum must be at least 1")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"TrainConfig: need 0 <= min_lr <= lr and lr > 0 (lr={self.lr}, "
                              f"min_lr={self.min_lr})")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"TrainConfig.betas must be two numbers in [0, 1), got {self.betas}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ConfigError("TrainConfig: eps must be > 0 and weight_decay >= 0")
        if abs(self.seed) >= 2**62:  # torch.manual_seed takes 64 bits; ranks and rollbacks add offsets to it
            raise ConfigError("TrainConfig.seed must be an integer of magnitude below 2**62, got "
                              f"{self.seed}")
        if self.warmup < 0:
            raise ConfigError("TrainConfig.warmup must be >= 0 (steps, or a fraction < 1), got "
                              f"{self.warmup}")
        if self.warmup >= 1 and not float(self.warmup).is_integer():
            raise ConfigError("TrainConfig.warmup >= 1 counts steps and must be a whole number, got "
                              f"{self.warmup}")
        if self.schedule == "noam" and self.warmup_steps() < 1:
            raise ConfigError("TrainConfig: schedule=noam needs warmup >= 1 step (it divides by warmup^1.5)")
        if self.clip_grad is not None and self.clip_grad <= 0:
            raise ConfigError("TrainConfig.clip_grad must be > 0, or null to turn clipping off")
        if not 0 < self.rollback_lr_factor <= 1:
            raise ConfigError("TrainConfig.rollback_lr_factor must be in (0, 1]")
        for name in ("log_every",):
            if getattr(self, name) < 1:
                raise ConfigError(f"TrainConfig.{name} must be at least 1")
        for name in ("eval_every", "save_every", "diag_every", "keep_last", "max_rollbacks", "max_skips"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"TrainConfig.{name} must be >= 0, got {value}")
        if self.max_eval_batches is not None and self.max_eval_batches < 0:
            raise ConfigError(f"TrainConfig.max_eval_batches must be >= 0, got {self.max_eval_batches}")
        if not (self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device)):
            raise ConfigError(f"TrainConfig.device: {self.device!r} is not auto, cpu, cuda or cuda:N")

    def warmup_steps(self) -> int:
        """Warmup in steps: `warmup` itself when >= 1, else that fraction of max_steps (rounded)."""
        return int(self.warmup) if self.warmup >= 1 else int(round(self.warmup * self.max_steps))

    def misleading(self, evaluates: bool) -> list[str]:
        """Notes on settings that run but do not do what they seem to (`evaluates`: the trainer has an
        evaluation to run)."""
        notes = []
        # every schedule but noam (whose warmup sets its peak) ramps linearly to train.lr over the warmup
        if self.schedule != "noam" and self.warmup_steps() >= self.max_steps:  # a smoke run's, often
            decays = " and never decays" if self.schedule != "constant" else ""
            notes.append(f"warmup of {self.warmup_steps()} steps >= max_steps={self.max_steps}: the "
                         f"{self.schedule} schedule never reaches train.lr{decays} (a warmup < 1 is a share "
                         "of max_steps)")
        if self.eval_every and not evaluates:
            notes.append(f"train.eval_every={self.eval_every} has nothing to evaluate (no evaluation "
                         "function, train.max_eval_batches=0): no evaluation runs during training (qkv "
                         "train: set eval.during_training=N held-out examples)")
        return notes


def train_overrides(overrides: list[str] | None) -> dict[str, Any]:
    """The Trainer settings of a `qkv finetune` command line's train.key=value overrides, as {key: value}
    without the prefix; any other key is one error, the same for every recipe. The values are YAML
    scalars, checked when the TrainConfig is built (qkv.config.from_dict)."""
    over = parse_overrides(list(overrides or []))
    bad = [k for k in over if not k.startswith("train.")]
    if bad:
        raise ConfigError(f"override {bad[0]!r}: qkv finetune takes Trainer settings as train.key=value "
                          "(e.g. train.lr=2e-5)")
    return {k[len("train."):]: v for k, v in over.items()}
