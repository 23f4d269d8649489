"""TrainConfig: every knob of the training loop, one strict dataclass.

Built with `qkv.config.from_dict(TrainConfig, mapping)` (YAML / `train.key=value` overrides): an unknown key
is a ConfigError naming the closest valid key, and `validate()` rejects a value outside its declared bounds
or inconsistent with another in one sentence naming the field. A `TrainConfig(...)` built directly gets the
same checks from `validate()` (the Trainer calls it). docs/training.md's table of the keys is generated from
the declarations (a test compares).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch

from qkv.config import ConfigError, check_fields, parse_overrides, setting
from qkv.train.optim import OptimizerImpl

Schedule = Literal["noam", "inverse_sqrt", "cosine", "linear", "constant"]
Precision = Literal["auto", "fp32", "bf16", "fp16"]
NanPolicy = Literal["skip", "stop", "rollback"]
Distributed = Literal["auto", "none", "ddp", "fsdp"]


@dataclass
class TrainConfig:
    # -- length and batch ------------------------------------------------------------------------------
    max_steps: int = setting(1000, "optimizer updates", ge=1)
    batch_size: int = setting(32, "sequences per micro-batch per process", ge=1)
    grad_accum: int = setting(1, "micro-batches per update (token-normalised: exactly a bigger batch)", ge=1)
    # -- optimizer: AdamW (Loshchilov & Hutter 2019) -----------------------------------------------------
    lr: float = setting(3e-4, "peak learning rate; for schedule=noam the paper's factor (LR = factor * "
                        "noam(step))", gt=0)
    min_lr: float = setting(0.0, "floor of the cosine / linear decay (at most lr)", ge=0)
    betas: list[float] = setting([0.9, 0.98], "AdamW's two betas, each in [0, 1) (the seeds: beta2 in "
                                 "0.95..0.98)")
    eps: float = setting(1e-8, "AdamW's epsilon (the seeds: 1e-6..1e-8)", gt=0)
    weight_decay: float = setting(0.1, "decoupled; never applied to norms, biases or embeddings", ge=0)
    optimizer_impl: OptimizerImpl = setting(
        "auto", "torch's AdamW kernel: auto = fused where torch has it (CPU, CUDA), else foreach; the same "
        "update to float rounding (qkv/train/optim.py)")
    # -- schedule ----------------------------------------------------------------------------------------
    schedule: Schedule = setting("cosine", "the learning-rate schedule")
    warmup: float = setting(0.02, "warmup: steps when >= 1 (a whole number), else a share of max_steps", ge=0,
                            note="0 = no warmup, the ablation")
    # -- stability ---------------------------------------------------------------------------------------
    clip_grad: float | None = setting(1.0, "global-norm clipping threshold", gt=0,
                                      none="off; the norm is still logged")
    nan_policy: NanPolicy = setting("stop", "what a non-finite loss or gradient does")
    rollback_lr_factor: float = setting(0.5, "rollback multiplies the LR by this each time", gt=0, le=1)
    max_rollbacks: int = setting(3, "rollbacks before giving up with NonFiniteError", ge=0)
    # a run that keeps producing NaNs is broken, and should end with an error, not a stale loss
    max_skips: int | None = setting(10, "skipped updates allowed before stopping", ge=0, none="no limit")
    # -- numerics and speed ------------------------------------------------------------------------------
    precision: Precision = setting(
        "auto", "auto (bf16 on a GPU that has it, fp32 on a CPU: train/precision.py), fp32, bf16 (autocast, "
        "CPU and CUDA) or fp16 (autocast + GradScaler, CUDA)")
    compile: bool = setting(False, "torch.compile the model (checkpoints never carry `_orig_mod.`)")
    grad_checkpointing: bool = setting(False, "recompute each block's activations in backward (less memory)")
    device: str = setting("auto", "auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    distributed: Distributed = setting("auto", "auto: ddp under torchrun with more than one process")
    ddp_find_unused: bool = setting(False, "DDP: allow parameters that get no gradient (an unused pooler)")
    # -- logging, evaluation, checkpoints ----------------------------------------------------------------
    log_every: int = setting(10, "steps between metrics.jsonl records", ge=1)
    eval_every: int = setting(0, "steps between evaluations", ge=0, note="0 = only at the end")
    max_eval_batches: int | None = setting(
        None, "held-out val batches for the loss when there is no evaluation function (one with a "
        "max_eval_batches parameter receives it)", ge=0, none="all")
    # SIGINT / SIGTERM always save the current step; this bounds what a hard kill (SIGKILL, OOM, power) loses:
    # HF Trainer's default, minutes of CPU work for the shipped configs, < 1% of the time in writes
    save_every: int = setting(500, "steps between checkpoints", ge=0, note="0 = only at the end")
    keep_last: int = setting(3, "newest periodic checkpoints kept (best-by-eval is kept separately)", ge=0,
                             note="0 = all")
    best_metric: str | None = setting(None, "eval metric that selects checkpoints/best",
                                      none="the task's primary metric, or the held-out loss")
    best_mode: Literal["min", "max"] | None = setting(None, "whether best_metric is best low or high",
                                                      none="the metric's direction as the task declares it")
    diag_every: int = setting(0, "steps between per-layer grad / weight norm records", ge=0, note="0 = off")
    progress: bool = setting(True, "tqdm progress bar (rank 0)")
    tensorboard: bool = setting(True, "TensorBoard event files when `tensorboard` is installed")
    plot: bool = setting(True, "curves.png (loss, LR, grad norm, eval metrics) at the end")
    out_dir: str = setting("runs/default", "the run folder")
    resume: bool = setting(False, "continue from out_dir's last checkpoint when there is one")
    # python, numpy and torch RNGs (data order comes from the batch source's own seed); torch.manual_seed
    # takes 64 bits, and ranks and rollbacks add offsets to it
    seed: int = setting(0, "random seed")

    def validate(self) -> None:
        if isinstance(self.device, torch.device):  # TrainConfig(device=torch.device("cuda", 1)) from Python
            self.device = str(self.device)
        check_fields(self)  # types, bounds and choices, also for a TrainConfig(...) built directly in Python

        def need(ok: bool, field: str, problem: str) -> None:
            if not ok:
                raise ConfigError(problem, field, "TrainConfig")

        need(abs(self.seed) < 2**62, "seed", f"must be an integer of magnitude below 2**62, got {self.seed}")
        need(self.min_lr <= self.lr, "min_lr", f"must be at most lr ({self.lr}), got {self.min_lr}")
        need(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), "betas",
             f"must be two numbers in [0, 1), got {self.betas}")
        need(self.warmup < 1 or float(self.warmup).is_integer(), "warmup",
             f">= 1 counts steps and must be a whole number, got {self.warmup}")
        need(self.schedule != "noam" or self.warmup_steps() >= 1, "warmup",
             "must be at least 1 step for schedule=noam (it divides by warmup^1.5)")
        need(self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device) is not None,
             "device", f": {self.device!r} is not auto, cpu, cuda or cuda:N")

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
