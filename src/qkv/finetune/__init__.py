"""Fine-tuning a pretrained model folder on the user's own data: one command for every kind of model.

    qkv finetune DIR --data FILE --out OUT [--task T] [--dev FILE] [task flags] [train.key=value ...]

`--task` picks the recipe; without it the model's kind decides (decoder -> chat, encoder -> classify,
seq2seq -> seq2seq). Each recipe is one module of this package that registers itself (registry), with a
settings dataclass the command line's flags are made from (settings), so the CLI never changes when a recipe
is added:

    chat      decoder models: chat / instruction data, loss on assistant tokens only; full or LoRA
    classify  encoder models: text or text-pair classification
    tag       encoder models: token classification (CoNLL BIO tags)
    mlm       encoder models: masked-LM training on a text file
    seq2seq   encoder-decoder models: source/target pairs
    image-classify  image classifiers (ViT, ResNet, Swin): a folder with one sub-folder of images per class

Every recipe is a phased object (recipe) that trains with qkv.train.Trainer (schedules, clipping, bf16,
checkpoints, exact resume, DDP/FSDP under torchrun) and writes OUT as a model folder that qkv and Hugging
Face `transformers` load; what may be done to OUT is decided in one place (out), the data files are read in
another (data).
"""

from __future__ import annotations

from collections.abc import Callable

from qkv.finetune.out import FINETUNE_FILE, check_out, mark_out, written_by
from qkv.finetune.recipe import FinetuneRecipe, FinetuneResult, epoch_updates, epochs_to_steps
from qkv.finetune.registry import Recipe, check_launch, choose, model_kind, recipe_for, recipes, select
from qkv.finetune.settings import FinetuneSettings


def finetune(settings: FinetuneSettings, note: Callable[[str], None] | None = None) -> FinetuneResult:
    """Fine-tune with the recipe whose settings these are: OUT checked before anything is read, trained or
    written, then the recipe's phases (`note` hears what the user should know before training starts)."""
    recipe = recipe_for(settings)
    check_launch(recipe)
    check_out(settings.out, settings.model, recipe.name, settings.resume)
    return recipe.recipe(settings).run(note)


__all__ = ["FINETUNE_FILE", "FinetuneRecipe", "FinetuneResult", "FinetuneSettings", "Recipe", "check_out",
           "choose", "epoch_updates", "epochs_to_steps", "finetune", "mark_out", "model_kind", "recipes",
           "select", "written_by"]
