"""A fine-tuning recipe as torchtune shapes one: an object built from its complete settings dataclass
(qkv.finetune.settings) whose named phases each return what they made, so that a caller (or a test) can run
them one by one; run() runs them in order and returns a FinetuneResult, which the command line prints.

    setup_model() -> model      the source folder read and checked, its tokenizer, the model to train
    setup_data()  -> data       the training (and --dev) data read, checked and encoded
    train()       -> summary    qkv.train.Trainer's run (OUT marked as this recipe's first, for --resume)
    save()        -> record     OUT as a model folder, and finetune.json (what the run did and scored)
    report()      -> lines      what `qkv finetune` prints

Also the epoch arithmetic every recipe turns --epochs into Trainer steps with.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qkv.config import ConfigError, apply_overrides, from_dict
from qkv.finetune.settings import FinetuneSettings
from qkv.train import TrainConfig
from qkv.train.distributed import world_size


@dataclass
class FinetuneResult:
    summary: dict[str, Any]  # the Trainer's: steps, losses, the best evaluation
    record: dict[str, Any] = field(default_factory=dict)  # OUT/finetune.json (empty on ranks other than 0)
    report: list[str] = field(default_factory=list)  # the lines `qkv finetune` prints


class FinetuneRecipe:
    """The base of every recipe: a subclass names its `settings` class and writes the phases. `notes` are
    what the user should know before training starts (said by run's `note`); `is_main` is False on the
    ranks of a torchrun launch that neither export nor report."""

    name = ""
    settings: type[FinetuneSettings] = FinetuneSettings

    def __init__(self, settings: FinetuneSettings) -> None:
        if not isinstance(settings, self.settings):
            raise TypeError(f"the {self.name} recipe takes {self.settings.__name__}, not "
                            f"{type(settings).__name__}")
        self.s = settings
        self.notes: list[str] = []
        self.is_main = True

    def setup_model(self) -> Any:
        raise NotImplementedError

    def setup_data(self) -> Any:
        raise NotImplementedError

    def train(self) -> dict[str, Any]:
        raise NotImplementedError

    def save(self) -> dict[str, Any]:
        raise NotImplementedError

    def report(self) -> list[str]:
        raise NotImplementedError

    def run(self, note: Callable[[str], None] | None = None) -> FinetuneResult:
        """Every phase in order; `note` hears the notes before the data are read and training starts."""
        self.setup_model()
        for text in self.notes if note is not None else ():
            note(text)
        self.setup_data()
        summary = self.train()
        if not self.is_main:
            return FinetuneResult(summary)
        record = self.save()
        return FinetuneResult(summary, record, self.report())


def epoch_updates(n_examples: int, batch_size: int, grad_accum: int = 1) -> int:
    """Optimizer updates in one pass over `n_examples`: each update reads batch_size x grad_accum examples on
    each rank of the launch (torchrun's WORLD_SIZE), the values after the train.key=value overrides. What
    every recipe turns --epochs into steps with, and evaluates and saves by."""
    return max(1, math.ceil(n_examples / max(1, batch_size * grad_accum * world_size())))


def epochs_to_steps(epochs: float, per_epoch: int) -> int:
    """train.max_steps for --epochs passes of `per_epoch` updates (a started pass counts whole)."""
    if epochs <= 0:
        raise ConfigError(f"--epochs must be positive, got {epochs:g}")
    return max(1, math.ceil(epochs * per_epoch - 1e-9))  # 1e-9: 0.1 x 30 is 3.0000000000000004 in floats


def epoch_config(s: FinetuneSettings, defaults: dict[str, Any], n_train: int, has_dev: bool) -> TrainConfig:
    """TrainConfig of a recipe that counts in epochs: its `defaults`, --epochs as max_steps (an epoch in
    updates of the batch the Trainer will read, train.batch_size / grad_accum included), an evaluation (with
    --dev) and a checkpoint each epoch, the run's OUT, resume, seed and progress, then train.key=value."""
    batch = {**defaults, **s.train}
    per_epoch = epoch_updates(n_train, int(batch.get("batch_size", 1)), int(batch.get("grad_accum", 1)))
    base = {**defaults, "max_steps": epochs_to_steps(float(s.epochs), per_epoch),
            "eval_every": per_epoch if has_dev else 0, "save_every": per_epoch, "out_dir": str(s.out),
            "resume": s.resume, "seed": s.seed, "progress": s.progress}
    data = apply_overrides({"train": base}, {f"train.{k}": v for k, v in s.train.items()},
                           "fine-tuning settings")
    return from_dict(TrainConfig, data["train"])


__all__ = ["FinetuneRecipe", "FinetuneResult", "epoch_config", "epoch_updates", "epochs_to_steps"]
