"""`qkv finetune`: its flags made from the recipes' settings dataclasses (qkv.finetune.settings), the chosen
recipe's settings built from the flags given, the recipe run and its report printed.

The common flags are FinetuneSettings' fields; each recipe's own fields are its group's flags. A flag stands
for one field of every recipe that has it (defined once: argparse takes one definition), and belongs to the
first recipe that declares it and does not list it in its `reads`. A flag the chosen recipe does not read is
refused (it would be silently ignored: --lora with --task classify trained every weight). A flag that is a
Trainer setting too (--seed, train.seed) is one setting: both given with different values is one error.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import Any

from qkv.cli.args import FinetuneArgs
from qkv.cli.flags import FlagSet, add_flags, check_flags, command_table, flags_table, option
from qkv.config import ConfigError, check_flag_keys

# FinetuneSettings' fields made flags of the common group (model, the positional argument, goes first)
COMMON = ("data", "out", "dev", "resume", "seed", "progress", "epochs", "too_long")
# what applies when the flag is not given: the recipe's default
DEFAULTS = {"epochs": "chat 1, the other recipes 3", "too_long": "error for chat and seq2seq, truncate for "
                                                                  "classify/tag"}


def own_fields(cls: type) -> list[str]:
    """The fields a recipe's settings add to FinetuneSettings' (its group's flags)."""
    from qkv.finetune.settings import FinetuneSettings  # the recipes import torch: only for this command

    common = {f.name for f in fields(FinetuneSettings)}
    return [f.name for f in fields(cls) if f.name not in common]


def groups() -> list[tuple[Any, list[str]]]:
    """(recipe, the fields its group has flags for), for every recipe that has a group."""
    from qkv.finetune import recipes

    owners = recipe_flags()
    found = [(r, [name for name in own_fields(r.settings) if owners.get(name) == r.name])
             for r in recipes().values()]
    return [(r, names) for r, names in found if names]


def recipe_flags() -> dict[str, str]:
    """{field: the recipe whose group has its flag} for every recipe's own fields."""
    from qkv.finetune import recipes

    owners: dict[str, str] = {}
    for r in recipes().values():
        for name in own_fields(r.settings):
            if name not in r.reads:
                owners.setdefault(name, r.name)
    return owners


def common_flags() -> tuple[FlagSet, ...]:
    """The flags every recipe takes: the model, the command's own, FinetuneSettings' common ones."""
    from qkv.finetune import FinetuneSettings

    return (FlagSet(FinetuneSettings, ("model",)), FlagSet(FinetuneArgs),
            FlagSet(FinetuneSettings, COMMON, DEFAULTS))


def add_finetune(p: argparse.ArgumentParser) -> None:
    """The `qkv finetune` command line: the common flags, then one group per recipe."""
    for flag_set in common_flags():
        flag_set.add(p)
    for r, names in groups():
        add_flags(p.add_argument_group(f"--task {r.name}", r.description), r.settings, only=names)


def flags_tables() -> str:
    """The Markdown tables of the flags add_finetune makes from the settings: the common ones, then each
    recipe's group (docs/finetune.md holds them: a test compares)."""
    parts = ["Every recipe:", "", command_table(common_flags())]
    for r, names in groups():
        parts += ["", f"`--task {r.name}`:", "", flags_table(r.settings, only=names)]
    return "\n".join(parts)


def refuse_foreign(a: argparse.Namespace, recipe: Any) -> dict[str, Any]:
    """{field: value} of the recipe flags given, each one the chosen recipe reads; another recipe's flag is
    one error naming it and its recipe."""
    owners = recipe_flags()
    own = set(own_fields(recipe.settings))
    given = {name: getattr(a, name) for name in owners if getattr(a, name, None) is not None}
    for name in sorted(given, key=option):
        if name not in own:
            hint = f"; set train.{name}=... instead" if name in ("batch_size", "lr") else ""
            raise ConfigError(f"{option(name)} is not supported by --task {recipe.name} (it is a --task "
                              f"{owners[name]} flag){hint}")
    return given


def check_train_flags(values: dict[str, Any], cls: type, overrides: list[str]) -> None:
    """A flag that is a Trainer setting and its train.key=value given with different values: one error naming
    the two (qkv.config.check_flag_keys, the rule of `qkv train` too)."""
    from qkv.finetune.settings import TRAIN_KEYS, train_value
    from qkv.train.config import train_overrides

    train = train_overrides(overrides)
    names = {f.name for f in fields(cls)}
    pairs, theirs = [], {}
    for name, key, kind in TRAIN_KEYS:
        if name not in names:
            continue  # another recipe's flag (refused when given): train.key is the only way
        if key in train:
            theirs[f"train.{key}"] = train_value(key, train[key], kind)
        value = values.get(name)
        flag = "--no-progress" if name == "progress" and value is False else option(name)
        shown = None if value is None else str(value) if name == "out" else value
        pairs.append((flag, shown, f"train.{key}"))
    check_flag_keys(pairs, overrides, theirs)


def read_settings(a: argparse.Namespace, recipe: Any) -> Any:
    """The chosen recipe's settings of the flags given (the others keep its defaults)."""
    from qkv.train.config import train_overrides

    given = refuse_foreign(a, recipe)
    common = {name: getattr(a, name) for name in COMMON if getattr(a, name, None) is not None}
    values = {"model": a.model, "out": a.out, **common, **given}
    check_train_flags(values, recipe.settings, list(a.overrides or []))
    values["train"] = train_overrides(a.overrides)
    check_flags(recipe.settings, values)  # an error about one setting is said with its flag
    return recipe.settings(**values)


def cmd_finetune(a: argparse.Namespace) -> int:
    from qkv.finetune import finetune, select

    recipe = select(a.model, a.task, a.data, a.dev)
    result = finetune(read_settings(a, recipe), note=lambda text: print(f"qkv: {text}", file=sys.stderr))
    if result.report:
        print("\n".join(result.report))
    return 0

