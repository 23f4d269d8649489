"""Fine-tuning a pretrained model folder on the user's own data: one command for every kind of model.

    qkv finetune DIR --data FILE --out OUT [--task T] [--dev FILE] [task flags] [train.key=value ...]

`--task` picks the recipe; without it the model's kind decides (decoder -> chat, encoder -> classify,
seq2seq -> seq2seq). Each recipe is one module of this package that registers itself here with the flags it
adds to the command line, so the CLI never changes when a recipe is added:

    chat      decoder models: chat / instruction data, loss on assistant tokens only; full or LoRA
    classify  encoder models: text or text-pair classification
    tag       encoder models: token classification (CoNLL BIO tags)
    seq2seq   encoder-decoder models: source/target pairs
    image-classify  image classifiers (ViT, ResNet, Swin): a folder with one sub-folder of images per class

Every recipe trains with qkv.train.Trainer (schedules, clipping, bf16, checkpoints, exact resume, DDP/FSDP
under torchrun) and writes OUT as a model folder that qkv and Hugging Face `transformers` load.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from qkv.config import ConfigError, check_flag_keys, parse_overrides, suggest

DEFAULT_BY_KIND = {"decoder": "chat", "encoder": "classify", "seq2seq": "seq2seq"}
FINETUNE_FILE = "finetune.json"  # in OUT: the recipe that wrote it, its settings and results


@dataclass(frozen=True)
class Recipe:
    """One fine-tuning recipe. run(args) trains and returns a summary dict with a printable "report"."""

    name: str
    kinds: tuple[str, ...]  # the model kinds it fine-tunes (see qkv.models: kinds)
    description: str
    run: Callable[[argparse.Namespace], dict[str, Any]]
    add_arguments: Callable[[argparse._ArgumentGroup], None] | None = None  # its own flags, in its own group
    distributed: bool = False  # runs under torchrun (DDP/FSDP): rank 0 alone evaluates, exports and reports
    data_folder: bool = False  # --data / --dev name folders, not files
    # flags another recipe's group defines that this one reads too, with this recipe's defaults: argparse
    # takes one definition of a flag, and its owner stays the recipe named when a third one is refused
    reads: tuple[tuple[str, Any], ...] = ()


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
    p.add_argument("--data", required=True,
                   help="training data file (its format depends on --task; a folder for image-classify)")
    p.add_argument("--dev", default=None, help="held-out data file, evaluated during and after training")
    p.add_argument("--out", required=True, help="output folder (a model folder qkv and transformers load)")
    p.add_argument("--task", default=None, help="recipe: " + ", ".join(sorted(recipes())) +
                   " (default: from the model's kind); the flags of another recipe's group below are refused")
    p.add_argument("--resume", action="store_true", help="continue OUT's last checkpoint")
    p.add_argument("--seed", type=int, default=None, help="random seed (default 0; the same as train.seed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (train.progress=false)")
    # flags several recipes share, defined once here (argparse refuses a second definition); None = the
    # recipe's own default (see shared())
    p.add_argument("--epochs", type=float, default=None,
                   help="passes over the training data when train.max_steps is not given (default: chat 1, "
                        "classify/tag/seq2seq 3)")
    p.add_argument("--too-long", choices=("error", "skip", "truncate"), default=None,
                   help="an example over the length limit: error naming it, skip it (chat) or truncate it "
                        "(classify, tag, seq2seq); default: error for chat and seq2seq, truncate for "
                        "classify/tag")
    flags: dict[str, RecipeFlag] = {}
    for r in recipes().values():
        if r.add_arguments is not None:
            group = p.add_argument_group(f"--task {r.name}", r.description)
            r.add_arguments(_RecipeGroup(group, r.name, flags))
    for r in recipes().values():
        for dest, default in r.reads:
            flags[dest] = replace(flags[dest], readers={**flags[dest].readers, r.name: default})
    p.set_defaults(recipe_flags=flags)  # read by resolve_flags from the parsed arguments


@dataclass(frozen=True)
class RecipeFlag:
    recipe: str  # the recipe whose group added it
    option: str  # "--lora-rank"
    default: Any  # the value it takes when not given
    readers: dict[str, Any] = field(default_factory=dict)  # other recipes that read it -> their defaults

    def read_by(self, recipe: str) -> bool:
        return recipe == self.recipe or recipe in self.readers


class _RecipeGroup:
    """A recipe's argument group that parses each of its flags as None when not given (so that a flag given
    is told from a default, and another recipe's flag can be refused) and records its default in `flags`."""

    def __init__(self, group: argparse._ArgumentGroup, recipe: str, flags: dict[str, RecipeFlag]) -> None:
        self.group, self.recipe, self.flags = group, recipe, flags

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:
        switch = {"store_true": False, "store_false": True}.get(kwargs.get("action", ""))
        default = kwargs.pop("default", switch)
        action = self.group.add_argument(*names, default=None, **kwargs)
        self.flags[action.dest] = RecipeFlag(self.recipe, names[0], default)
        return action

    def __getattr__(self, name: str) -> Any:  # the rest of the group's interface (a title, a description)
        return getattr(self.group, name)


def resolve_flags(args: argparse.Namespace, recipe: str) -> None:
    """Refuse a flag of another recipe (it would be silently ignored: e.g. --lora with --task classify trained
    every weight), then give the chosen recipe's flags that were not given their defaults. args.given_flags:
    the dests of the recipe flags the user set (a recipe may refuse combinations, e.g. --lora-rank without
    --lora)."""
    flags: dict[str, RecipeFlag] = getattr(args, "recipe_flags", {})
    given = {dest for dest in flags if getattr(args, dest, None) is not None}
    for dest in sorted(given, key=lambda d: flags[d].option):
        flag = flags[dest]
        if not flag.read_by(recipe):
            hint = f"; set train.{dest}=... instead" if dest in ("batch_size", "lr") else ""
            raise ConfigError(f"{flag.option} is not supported by --task {recipe} (it is a --task "
                              f"{flag.recipe} flag){hint}")
    for dest, flag in flags.items():
        if dest not in given:
            setattr(args, dest, flag.readers.get(recipe, flag.default))
    args.given_flags = given


# The flags that stand for a Trainer setting: (args dest, train key, flag). Both say the same thing, so each
# recipe must read one value whichever the user wrote: see train_flags.
TRAIN_FLAGS = (("out", "out_dir", "--out"), ("resume", "resume", "--resume"), ("seed", "seed", "--seed"),
               ("no_progress", "progress", "--no-progress"), ("batch_size", "batch_size", "--batch-size"),
               ("lr", "lr", "--lr"))


def _as(key: str, value: Any, kind: type) -> Any:
    """An override's value as the flag's type (a clear error for one that is not)."""
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
        return value
    raise ConfigError(f"train.{key}={value!r}: expected {'true or false' if kind is bool else kind.__name__}")


def train_flags(args: argparse.Namespace, recipe: str) -> None:
    """Make each flag of TRAIN_FLAGS and its train.key=value override one setting, for every recipe alike:
    either may be given (the override then sets the flag's value in args, which the recipe reads before the
    Trainer: the seed of the data order and the new head, check_out's resume, the batch --epochs counts in),
    and both given with different values is one error naming the two (qkv.config.check_flag_keys, the rule
    of `qkv train` too). Run after resolve_flags (a recipe flag is given when args.given_flags holds it)."""
    overrides = list(getattr(args, "overrides", None) or [])
    over = parse_overrides(overrides)
    flags: dict[str, RecipeFlag] = getattr(args, "recipe_flags", {})
    pairs, values = [], {}
    for dest, key, flag in TRAIN_FLAGS:
        if dest in flags and not flags[dest].read_by(recipe):
            continue  # another recipe's flag (refused by resolve_flags when given): train.key is the only way
        current, given = getattr(args, dest, None), _given(args, dest, flags)
        if f"train.{key}" in over:
            values[f"train.{key}"] = _as_flag(dest, key, over[f"train.{key}"])
        pairs.append((flag, current if given else None, f"train.{key}"))
    check_flag_keys(pairs, overrides, values)
    for dest, key, _ in TRAIN_FLAGS:
        if f"train.{key}" in values:
            setattr(args, dest, values[f"train.{key}"])
    if getattr(args, "seed", None) is None:
        args.seed = 0


def _given(args: argparse.Namespace, dest: str, flags: dict[str, RecipeFlag]) -> bool:
    """Whether the user gave the flag of `dest` (a store_true flag can only be written as True)."""
    if dest in flags:
        return dest in getattr(args, "given_flags", set())
    if dest in ("resume", "no_progress"):
        return bool(getattr(args, dest, None))
    return getattr(args, dest, None) is not None  # --out is required; --seed defaults to None


def _as_flag(dest: str, key: str, value: Any) -> Any:
    """A train.key=value override's value as its flag's value (train.progress=false is --no-progress)."""
    if dest == "out":  # compared as a path by check_flag_keys: train.out_dir
        return str(value)
    if dest == "no_progress":
        return not _as(key, value, bool)
    return _as(key, value, {"resume": bool, "seed": int, "batch_size": int, "lr": float}[dest])


def shared(args: argparse.Namespace, name: str, default: Any, allowed: tuple[Any, ...] | None = None,
           recipe: str = "") -> Any:
    """A shared flag's value for one recipe: its default when not given, checked against what the recipe
    supports (e.g. chat cannot truncate a conversation)."""
    value = getattr(args, name, None)
    value = default if value is None else value
    if allowed is not None and value not in allowed:
        flag = "--" + name.replace("_", "-")
        raise ConfigError(f"{flag} {value} is not supported by --task {recipe}; choose one of "
                          f"{', '.join(allowed)}")
    return value


def read_data_text(path: str | Path, where: str = "{path} line {line}") -> str:
    """The text of a data file, UTF-8, with a leading byte order mark dropped (Windows editors write one; left
    in, it would become part of the first column's name or the first record). Bytes that are not UTF-8 are one
    ConfigError naming the file, line and column (`where` formats the file and line as the reader's other
    errors do)."""
    path = Path(path)
    raw = path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start = raw.rfind(b"\n", 0, e.start) + 1
        at = where.format(path=path, line=raw.count(b"\n", 0, e.start) + 1)
        raise ConfigError(f"{at}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                          f"{e.start - line_start + 1}); "
                          "save the file as UTF-8") from None


def epoch_updates(n_examples: int, batch_size: int, grad_accum: int = 1) -> int:
    """Optimizer updates in one pass over `n_examples`: each update reads batch_size x grad_accum examples on
    each rank of the launch (torchrun's WORLD_SIZE), the values after the train.key=value overrides. What
    every recipe turns --epochs into steps with, and evaluates and saves by."""
    from qkv.train.distributed import world_size

    return max(1, math.ceil(n_examples / max(1, batch_size * grad_accum * world_size())))


def epochs_to_steps(epochs: float, per_epoch: int) -> int:
    """train.max_steps for --epochs passes of `per_epoch` updates (a started pass counts whole)."""
    if epochs <= 0:
        raise ConfigError(f"--epochs must be positive, got {epochs:g}")
    return max(1, math.ceil(epochs * per_epoch - 1e-9))  # 1e-9: 0.1 x 30 is 3.0000000000000004 in floats


def model_kind(folder: str | Path) -> str:
    """The kind of the model in `folder` (or in a qkv run folder's newest checkpoint), read from its
    config.json alone (no weights are loaded)."""
    from qkv.interop import KINDS
    from qkv.models.registry import family
    from qkv.run import run_folder_of
    from qkv.storage import CheckpointError, read_config
    from qkv.train import latest_checkpoint

    folder = Path(folder)
    if run_folder_of(folder) == folder.resolve() and not (folder / "config.json").is_file():
        folder = latest_checkpoint(folder / "checkpoints") or folder
    meta = read_config(folder)
    if "qkv_family" in meta:
        return family(meta["qkv_family"]).model_class.kinds[0]
    # a vision-language folder is a decoder with images in its prompts: the chat recipe (finetune.chat_images)
    vlm = meta.get("model_type") in ("llava", "idefics3", "smolvlm")
    kind = KINDS.get(meta.get("model_type")) or ("decoder" if vlm else None)
    if kind is None:
        raise CheckpointError(f"{folder}: Hugging Face model_type {meta.get('model_type')!r} is not "
                              "supported")
    return kind


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


def written_by(folder: Path) -> str | None:
    """The recipe whose output `folder` is (its finetune.json's "recipe", or "task" in older classify/tag
    folders), or None when qkv finetune did not write it."""
    try:
        meta = json.loads((folder / FINETUNE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = meta.get("recipe") or meta.get("task") if isinstance(meta, dict) else None
    return name if isinstance(name, str) else None


def check_out(out: str | Path, source: str | Path, recipe: str, resume: bool) -> None:
    """Refuse, before anything is read or written, an --out whose contents a run would destroy: the source
    model folder itself or a folder inside it, a file, a model folder or other files that qkv finetune did
    not write, another recipe's output, or this recipe's run with checkpoints when --resume is not given.
    What is left is a new or empty folder, or this recipe's own output (continued with --resume, else
    written over). Under torchrun rank 0 alone checks: a slower rank would find what rank 0 has begun to
    write, and a refusal on rank 0 stops every rank."""
    from qkv.train import latest_checkpoint
    from qkv.train.distributed import launched_by_torchrun

    if launched_by_torchrun() and os.environ["RANK"] != "0":
        return
    out, source = Path(out), Path(source)
    where, src = out.resolve(), source.resolve()
    if where == src:
        raise ConfigError(f"--out {out} already holds a model folder: the source model being fine-tuned; "
                          "choose another --out")
    if src in where.parents:
        raise ConfigError(f"--out {out} lies inside the source model folder {source}; choose another --out")
    for p in (out, *out.parents):
        if p.exists() and not p.is_dir():
            raise ConfigError(f"--out {out} is a file, not a folder" if p == out else
                              f"--out {out}: {p} is a file, not a folder")
    # .gitkeep, .DS_Store
    if not out.exists() or not any(p for p in out.iterdir() if not p.name.startswith(".")):
        return
    owner = written_by(out)
    if owner is None and resume and latest_checkpoint(out / "checkpoints") is not None:
        return  # a run of a qkv finetune from before finetune.json marked its folders: --resume continues it
    if owner is None:
        if (out / "config.json").is_file():
            raise ConfigError(f"--out {out} already holds a model folder that qkv finetune did not write; "
                              "choose another --out")
        names = sorted(p.name for p in out.iterdir())
        raise ConfigError(f"--out {out} already holds other files ({', '.join(names[:3])}"
                          f"{', ...' if len(names) > 3 else ''}); choose a new or empty folder")
    if owner != recipe:
        raise ConfigError(f"--out {out} already holds the output of qkv finetune --task {owner}; choose "
                          "another --out")
    if latest_checkpoint(out / "checkpoints") is not None and not resume:
        raise ConfigError(f"--out {out} already holds a fine-tuning run; pass --resume to continue it or "
                          "choose another --out")


def mark_out(out: str | Path, recipe: str) -> None:
    """Write OUT/finetune.json naming the recipe (rank 0 only), before training starts: it is what check_out
    recognises a run by, so an interrupted run can be resumed. The recipe rewrites the file with its results
    at the end."""
    from qkv.checkpoint import atomic_write_json
    from qkv.train.distributed import launched_by_torchrun

    out = Path(out)
    # a resumed run keeps the settings it recorded
    if (launched_by_torchrun() and os.environ["RANK"] != "0") or written_by(out) == recipe:
        return
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json({"recipe": recipe}, out / FINETUNE_FILE)


def finetune(args: argparse.Namespace) -> dict[str, Any]:
    """Run the chosen recipe (what `qkv finetune` calls)."""
    if not Path(args.model).exists():
        raise ConfigError(f"model folder not found: {args.model}")
    named = recipes().get(args.task or "")
    what = "folder" if named is not None and named.data_folder else "file"
    for name, path in (("data", args.data), ("dev", args.dev)):
        if path is None or (Path(path).is_dir() if what == "folder" else Path(path).is_file()):
            continue
        if what == "folder" and Path(path).exists():
            raise ConfigError(f"--{name} {path} is a file; --task {args.task} reads a folder with one "
                              "sub-folder of images per class")
        raise ConfigError(f"{name} {what} not found: {path}")
    recipe = choose(args.task, model_kind(args.model))
    from qkv.train.distributed import world_size

    if world_size() > 1 and not recipe.distributed:  # every rank would evaluate and export into OUT at once
        raise ConfigError(f"--task {recipe.name} does not run under torchrun yet (only --task chat does); "
                          "run it as one process")
    resolve_flags(args, recipe.name)
    train_flags(args, recipe.name)  # before check_out: train.resume=true is --resume
    check_out(args.out, args.model, recipe.name, args.resume)  # before anything is read, trained or written
    return recipe.run(args)


__all__ = ["DEFAULT_BY_KIND", "FINETUNE_FILE", "Recipe", "add_arguments", "check_out", "choose",
           "epoch_updates", "epochs_to_steps", "finetune", "mark_out", "model_kind", "read_data_text",
           "recipes", "register_recipe", "shared", "train_flags", "written_by"]
