"""Fine-tuning a pretrained model folder on the user's own data: one command for every kind of model.

    qkv finetune DIR --data FILE --out OUT [--task T] [--dev FILE] [task flags] [train.key=value ...]

`--task` picks the recipe; without it the model's kind decides (decoder -> chat, encoder -> classify,
seq2seq -> seq2seq). Each recipe is one module of this package that registers itself here with the flags it
adds to the command line, so the CLI never changes when a recipe is added:

    chat      decoder models: chat / instruction data, loss on assistant tokens only; full or LoRA
    classify  encoder models: text or text-pair classification
    tag       encoder models: token classification (CoNLL BIO tags)
    seq2seq   encoder-decoder models: source/target pairs

Every recipe trains with qkv.train.Trainer (schedules, clipping, bf16, checkpoints, exact resume, DDP/FSDP
under torchrun) and writes OUT as a model folder that qkv and Hugging Face `transformers` load.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv.config import ConfigError, _closest

DEFAULT_BY_KIND = {"decoder": "chat", "encoder": "classify", "seq2seq": "seq2seq"}


@dataclass(frozen=True)
class Recipe:
    """One fine-tuning recipe. run(args) trains and returns a summary dict with a printable "report"."""

    name: str
    kinds: tuple[str, ...]  # the model kinds it fine-tunes (see qkv.models: kinds)
    description: str
    run: Callable[[argparse.Namespace], dict[str, Any]]
    add_arguments: Callable[[argparse._ArgumentGroup], None] | None = None  # its own flags, in its own group


_RECIPES: dict[str, Recipe] = {}


def register_recipe(recipe: Recipe) -> None:
    _RECIPES[recipe.name] = recipe


def _load_all() -> None:
    """Import every module of this package (each registers its recipe)."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def recipes() -> dict[str, Recipe]:
    _load_all()
    return dict(_RECIPES)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `qkv finetune` command line: the common flags, then one group per recipe."""
    p.add_argument("model", help="a model folder (Hugging Face format or a qkv checkpoint/run folder)")
    p.add_argument("overrides", nargs="*", help="Trainer settings as train.key=value (e.g. train.lr=2e-5)")
    p.add_argument("--data", required=True, help="training data file (its format depends on --task)")
    p.add_argument("--dev", default=None, help="held-out data file, evaluated during and after training")
    p.add_argument("--out", required=True, help="output folder (a model folder qkv and transformers load)")
    p.add_argument("--task", default=None, help="recipe: " + ", ".join(sorted(recipes())) +
                   " (default: from the model's kind)")
    p.add_argument("--resume", action="store_true", help="continue OUT's last checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    for r in recipes().values():
        if r.add_arguments is not None:
            r.add_arguments(p.add_argument_group(f"--task {r.name}", r.description))


def model_kind(folder: str | Path) -> str:
    """The kind of the model in `folder`, read from its config.json alone (no weights are loaded)."""
    from qkv.interop import KINDS
    from qkv.models.registry import family
    from qkv.storage import CheckpointError, read_config

    meta = read_config(Path(folder))
    if "qkv_family" in meta:
        return family(meta["qkv_family"]).model_class.kinds[0]
    kind = KINDS.get(meta.get("model_type"))
    if kind is None:
        raise CheckpointError(f"{folder}: Hugging Face model_type {meta.get('model_type')!r} is not supported")
    return kind


def choose(task: str | None, kind: str) -> Recipe:
    """The recipe for `task` (or the model kind's default), checked against the model's kind."""
    all_ = recipes()
    name = task or DEFAULT_BY_KIND.get(kind)
    if name is None:
        raise ConfigError(f"no fine-tuning recipe for a model of kind {kind!r}; pass --task ({', '.join(sorted(all_))})")
    if name not in all_:
        raise ConfigError(f"unknown fine-tuning task {name!r}" +
                          _closest(name, list(all_)).replace("valid keys", "known tasks"))
    r = all_[name]
    if kind not in r.kinds:
        raise ConfigError(f"--task {name} fine-tunes {'/'.join(r.kinds)} models; this folder holds a {kind} model")
    return r


def finetune(args: argparse.Namespace) -> dict[str, Any]:
    """Run the chosen recipe (what `qkv finetune` calls)."""
    if not Path(args.model).exists():
        raise ConfigError(f"model folder not found: {args.model}")
    if not Path(args.data).is_file():
        raise ConfigError(f"data file not found: {args.data}")
    if args.dev is not None and not Path(args.dev).is_file():
        raise ConfigError(f"dev file not found: {args.dev}")
    return choose(args.task, model_kind(args.model)).run(args)


__all__ = ["DEFAULT_BY_KIND", "Recipe", "add_arguments", "choose", "finetune", "model_kind", "recipes",
           "register_recipe"]
