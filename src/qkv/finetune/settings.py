"""The settings of a fine-tuning run: one dataclass per recipe, built on FinetuneSettings (what every recipe
reads: the model, the data, OUT, the seed, --epochs, --too-long and the Trainer's train.key=value). A recipe
gets them complete and checked, and reads nothing else; `qkv finetune` builds them from its flags
(qkv.cli.finetune), a program builds them directly:

    finetune(ChatSettings(model="gpt2", data="chats.jsonl", out="sft", lora=True, train={"lr": 1e-4}))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from qkv.config import ConfigError, setting

# The settings that are a Trainer setting as well: (field, train key, type). train.key=value sets the field
# too, so that a recipe reads one value whichever was given: the seed of the data order and of a new head,
# check_out's resume, the batch --epochs counts in.
TRAIN_KEYS: tuple[tuple[str, str, type], ...] = (
    ("out", "out_dir", str), ("resume", "resume", bool), ("seed", "seed", int),
    ("progress", "progress", bool), ("batch_size", "batch_size", int), ("lr", "lr", float))


def train_value(key: str, value: Any, kind: type) -> Any:
    """A train.key=value override's value as its setting's type (a clear error for one that is not)."""
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        try:
            if not isinstance(value, bool):
                return float(value)  # YAML reads 3e-4 (no dot) as a string
        except (TypeError, ValueError):
            pass
    else:
        return kind(value)
    raise ConfigError(f"train.{key}={value!r}: expected {'true or false' if kind is bool else kind.__name__}")


@dataclass(kw_only=True)
class FinetuneSettings:
    """What every recipe reads. A subclass adds its recipe's own settings, sets its defaults of `epochs` and
    `too_long`, and names the --too-long values it supports in TOO_LONG (none: it does not read the
    setting)."""

    RECIPE: ClassVar[str] = ""
    TOO_LONG: ClassVar[tuple[str, ...]] = ()

    model: str = setting(help="a model folder (Hugging Face format or a qkv checkpoint/run folder)",
                         positional=True)
    data: str = setting(help="training data file (its format depends on --task; a folder for image-classify)")
    out: Path = setting(help="output folder (a model folder qkv and transformers load)")
    dev: str | None = setting(None, "held-out data file, evaluated during and after training")
    resume: bool = setting(False, "continue OUT's last checkpoint")
    seed: int = setting(0, "random seed (the same as train.seed)")
    progress: bool = setting(True, "a progress bar (the same as train.progress)")
    epochs: float = setting(3.0, "passes over the training data when train.max_steps is not given")
    too_long: str = setting("error", "an example over the length limit: error naming it, skip it (chat) or "
                                     "truncate it (classify, tag, seq2seq)",
                            choices=("error", "skip", "truncate"))
    train: dict[str, Any] = setting({}, "Trainer settings over the recipe's defaults (train.key=value)",
                                    flag=False)

    def __post_init__(self) -> None:
        for name, key, kind in TRAIN_KEYS:
            if key in self.train and hasattr(self, name):
                setattr(self, name, train_value(key, self.train[key], kind))
        self.out = Path(self.out)
        if self.TOO_LONG and self.too_long not in self.TOO_LONG:
            raise ConfigError(f"--too-long {self.too_long} is not supported by --task {self.RECIPE}; choose "
                              f"one of {', '.join(self.TOO_LONG)}")


__all__ = ["TRAIN_KEYS", "FinetuneSettings", "train_value"]
