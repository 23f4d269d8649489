"""The phases the encoder recipes (classify, tag, mlm) share, in the shape of qkv.finetune.recipe:

    setup_model() -> EncoderFolder   the Hugging Face encoder folder and its tokenizer
    setup_data()  -> EncodedData     the training (and --dev) files read, checked and encoded   [per recipe]
    train()       -> summary         a head on the encoder, trained by qkv.train.Trainer
    save()        -> record          OUT as a model folder (the best checkpoint's weights) + finetune.json
    report()      -> lines           what `qkv finetune` prints                                 [per recipe]
"""

from __future__ import annotations

from typing import Any

from qkv.finetune.encoders import (
    FINETUNE_DEFAULTS,
    EncodedData,
    EncoderFolder,
    best_state,
    export_folder,
    new_head_model,
    open_encoder,
)
from qkv.finetune.out import FINETUNE_FILE, mark_out
from qkv.finetune.recipe import FinetuneRecipe, epoch_config
from qkv.storage import atomic_write_json
from qkv.train import Trainer


class EncoderRecipe(FinetuneRecipe):
    """Base of the encoder recipes. A subclass sets `name` and `head`, and its setup_data() sets
    `train_data`, `dev` (EncodedData or None), `n_labels` and `id2label`; evaluate(model) scores `dev`."""

    head = ""

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self.dev: EncodedData | None = None
        self.result: dict[str, Any] = {}

    def setup_model(self) -> EncoderFolder:
        self.enc = open_encoder(self.s.model)
        return self.enc

    def evaluate(self, model: Any) -> dict[str, float]:
        raise NotImplementedError

    def start_model(self) -> Any:
        """The model training starts from: the folder's encoder under a new head, seeded."""
        return new_head_model(self.enc, self.head, self.n_labels, self.s.seed)

    def train(self) -> dict[str, Any]:
        cfg = epoch_config(self.s, FINETUNE_DEFAULTS, len(self.train_data), self.dev is not None)
        self.model = self.start_model()
        mark_out(self.s.out, self.name)  # the data are read and checked: the run starts
        trainer = Trainer(self.model, cfg, self.train_data,
                          eval_fn=self.evaluate if self.dev is not None else None)
        self.summary = trainer.fit()
        return self.summary

    def load_best(self, best: dict[str, Any]) -> None:
        self.model.load_state_dict(best)

    def save(self) -> dict[str, Any]:
        """OUT with the best checkpoint's weights (this run's, not an older run's), then the results."""
        best = best_state(self.s.out) if self.summary.get("best_eval") else None
        if best is not None:
            self.load_best(best)
        self.model.cpu().eval()
        export_folder(self.enc, self.model, self.s.out, self.id2label)
        self.result = self.results()
        atomic_write_json(self.result, self.s.out / FINETUNE_FILE)
        return self.result

    def results(self) -> dict[str, Any]:
        """What finetune.json records (the exported model evaluated on --dev, when given)."""
        raise NotImplementedError
