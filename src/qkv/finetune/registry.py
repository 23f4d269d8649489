"""The fine-tuning recipes: each recipe module of this package registers one Recipe record here (its name,
the model kinds it fine-tunes, its phased class and through it its settings), so that neither the command
line nor this package's face changes when a recipe is added. select() picks the recipe for a model folder
and --task before anything is loaded."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path

from qkv.config import ConfigError, suggest
from qkv.finetune.data import check_data_paths
from qkv.finetune.recipe import FinetuneRecipe
from qkv.finetune.settings import FinetuneSettings
from qkv.interop.registry import lookup
from qkv.models.registry import family
from qkv.run import run_folder_of
from qkv.storage import CheckpointError, read_config
from qkv.train import latest_checkpoint
from qkv.train.distributed import world_size

DEFAULT_BY_KIND = {"decoder": "chat", "encoder": "classify", "seq2seq": "seq2seq"}


@dataclass(frozen=True)
class Recipe:
    """One registered fine-tuning recipe."""

    name: str
    kinds: tuple[str, ...]  # the model kinds it fine-tunes (see qkv.models: kinds)
    description: str
    recipe: type[FinetuneRecipe]  # the phased class; its settings dataclass is recipe.settings
    distributed: bool = False  # runs under torchrun (DDP/FSDP): rank 0 alone evaluates, exports and reports
    data_folder: bool = False  # --data / --dev name folders, not files
    # settings of this recipe whose flag another recipe's group defines (a command line defines a flag once;
    # its owner stays the recipe named when a third one is refused); the defaults stay this recipe's
    reads: tuple[str, ...] = ()

    @property
    def settings(self) -> type[FinetuneSettings]:
        return self.recipe.settings


RECIPES: dict[str, Recipe] = {}


def register_recipe(recipe: Recipe) -> None:
    RECIPES[recipe.name] = recipe


def load_all() -> None:
    """Import every module of the package (each recipe module registers its recipe)."""
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        importlib.import_module(f"qkv.finetune.{info.name}")


def recipes() -> dict[str, Recipe]:
    """Every recipe, by name: one order whatever imported its module first (a flag two recipes share is
    the first one's, and the docs' tables follow this order)."""
    load_all()
    return dict(sorted(RECIPES.items()))


def recipe_for(settings: FinetuneSettings) -> Recipe:
    """The recipe whose settings dataclass `settings` is."""
    found = [r for r in recipes().values() if type(settings) is r.settings]
    if not found:
        raise TypeError(f"{type(settings).__name__} is no fine-tuning recipe's settings")
    return found[0]


def model_kind(folder: str | Path) -> str:
    """The kind of the model in `folder` (or in a qkv run folder's newest checkpoint), read from its
    config.json alone (no weights are loaded)."""
    folder = Path(folder)
    if run_folder_of(folder) == folder.resolve() and not (folder / "config.json").is_file():
        folder = latest_checkpoint(folder / "checkpoints") or folder
    meta = read_config(folder)
    if "qkv_family" in meta:
        return family(meta["qkv_family"]).model_class.kinds[0]
    record = lookup(meta.get("model_type"))  # a vision-language folder's kind: decoder (finetune.chat_images)
    if record is None:
        raise CheckpointError(f"{folder}: Hugging Face model_type {meta.get('model_type')!r} is not "
                              "supported")
    return record.kind


def choose(task: str | None, kind: str) -> Recipe:
    """The recipe for `task` (or the model kind's default), checked against the model's kind."""
    all_ = recipes()
    name = task or DEFAULT_BY_KIND.get(kind)
    if name is None:
        raise ConfigError(f"no fine-tuning recipe for a model of kind {kind!r}; pass --task "
                          f"({', '.join(sorted(all_))})")
    if name not in all_:
        raise ConfigError(f"unknown fine-tuning task {name!r}" +
                          suggest(name, list(all_), "known tasks"))
    r = all_[name]
    if kind not in r.kinds:
        raise ConfigError(f"--task {name} fine-tunes {'/'.join(r.kinds)} models; this folder holds a {kind} "
                          "model")
    return r


def check_launch(recipe: Recipe) -> None:
    """Refuse a recipe that does not divide its work under torchrun: every rank would evaluate and export into
    OUT at once."""
    if world_size() > 1 and not recipe.distributed:
        raise ConfigError(f"--task {recipe.name} does not run under torchrun yet (only --task chat does); "
                          "run it as one process")


def select(model: str | Path, task: str | None, data: str | Path, dev: str | Path | None) -> Recipe:
    """The recipe `qkv finetune` runs, with what can be checked before settings are read: the model folder
    and the data exist, --task suits the model's kind, the launch suits the recipe."""
    if not Path(model).exists():
        raise ConfigError(f"model folder not found: {model}")
    named = recipes().get(task or "")
    check_data_paths(data, dev, named is not None and named.data_folder, task)
    recipe = choose(task, model_kind(model))
    check_launch(recipe)
    return recipe


__all__ = ["DEFAULT_BY_KIND", "RECIPES", "Recipe", "check_launch", "choose", "load_all", "model_kind",
           "recipe_for", "recipes", "register_recipe", "select"]
