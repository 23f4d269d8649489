"""The phases the encoder recipes (classify, tag) share: a recipe object whose named phases each return what
they made, so that a caller (or a test) can run them one by one; only the registered entry point, run(),
hands the report to the command line, which prints it.

    setup_model() -> EncoderFolder   the Hugging Face encoder folder and its tokenizer
    setup_data()  -> EncodedData     the training (and --dev) files read, checked and encoded   [per recipe]
    train()       -> summary         a fresh head on the encoder, trained by qkv.train.Trainer
    save()        -> result          OUT as a model folder (the best checkpoint's weights) + finetune.json
    report()      -> lines           what `qkv finetune` prints                                 [per recipe]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv.finetune import FINETUNE_FILE, mark_out
from qkv.finetune.encoders import (
    EncodedData,
    EncoderFolder,
    best_state,
    export_folder,
    new_head_model,
    open_encoder,
    train_config,
)
from qkv.storage import atomic_write_json
from qkv.train import Trainer


@dataclass
class EncoderSettings:
    """What the encoder recipes read of the command line, in one place. `args` stays for what is parsed
    with the other recipes (train.key=value, --epochs, --too-long) and the recipe's own column flags."""

    model: str
    data: str
    dev: str | None
    out: Path
    seed: int
    args: argparse.Namespace

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EncoderSettings:
        return cls(model=args.model, data=args.data, dev=args.dev, out=Path(args.out), seed=args.seed,
                   args=args)


class PhasedRecipe:
    """A recipe whose entry point is its phases in order: setup_model, setup_data, train, save, report. A
    subclass names its settings class (`settings`, with from_args) and writes the phases."""

    settings: Any = None

    @classmethod
    def run(cls, args: argparse.Namespace) -> dict[str, Any]:
        """The registered entry point: every phase in order; the report travels as one string."""
        recipe = cls(cls.settings.from_args(args))
        recipe.setup_model()
        recipe.setup_data()
        recipe.train()
        result = recipe.save()
        return {**result, "report": "\n".join(recipe.report())}


class EncoderRecipe(PhasedRecipe):
    """Base of the encoder recipes. A subclass sets `name` and `head`, and its setup_data() sets
    `train_data`, `dev` (EncodedData or None), `n_labels` and `id2label`; evaluate(model) scores `dev`."""

    name = ""
    head = ""
    settings = EncoderSettings

    def __init__(self, settings: EncoderSettings) -> None:
        self.s = settings
        self.dev: EncodedData | None = None
        self.result: dict[str, Any] = {}

    def setup_model(self) -> EncoderFolder:
        self.enc = open_encoder(self.s.model)
        return self.enc

    def setup_data(self) -> EncodedData:
        raise NotImplementedError

    def evaluate(self, model: Any) -> dict[str, float]:
        raise NotImplementedError

    def train(self) -> dict[str, Any]:
        cfg = train_config(self.s.args, len(self.train_data), self.dev is not None)
        self.model = new_head_model(self.enc, self.head, self.n_labels, self.s.seed)
        mark_out(self.s.out, self.name)  # the data are read and checked: the run starts
        trainer = Trainer(self.model, cfg, self.train_data,
                          eval_fn=self.evaluate if self.dev is not None else None)
        self.summary = trainer.fit()
        return self.summary

    def save(self) -> dict[str, Any]:
        """OUT with the best checkpoint's weights (this run's, not an older run's), then the results."""
        best = best_state(self.s.out) if self.summary.get("best_eval") else None
        if best is not None:
            self.model.load_state_dict(best)
        self.model.cpu().eval()
        export_folder(self.enc, self.model, self.s.out, self.id2label)
        self.result = self.results()
        atomic_write_json(self.result, self.s.out / FINETUNE_FILE)
        return self.result

    def results(self) -> dict[str, Any]:
        """What finetune.json records (the exported model evaluated on --dev, when given)."""
        raise NotImplementedError

    def report(self) -> list[str]:
        raise NotImplementedError

