"""Command-line flags generated from settings dataclasses (fields declared with qkv.config.setting), so that
no bound, choice or help text is written twice:

    add_flags(p, ServeConfig)                      # a flag for each field declared with flag=True
    add_flags(p, GenerationConfig, only=("top_k", "top_p"), rules={"top_k": {"ge": 1}})
    given = read_flags(args, ServeConfig)          # {field: value} of the flags given, checked
    s = read_settings(args, ExportArgs)            # the dataclass of them, defaults for the rest
    flags_table(ServeConfig, EngineConfig)         # the Markdown table of docs/serving.md (a test compares)

Each flag is named after its field (`top_k` -> `--top-k`, or the spellings its `flag` metadata gives), typed
after its annotation (a Literal's values or the `choices` are the flag's choices; a bool is --X / --no-X; a
list takes several values), defaults to None (not given: the task's, the folder's, the file's or the
dataclass's value stands) and takes its help and bounds from the metadata; a field declared `positional` is
a positional argument. `rules` lays a command's own bounds over a field's (a request must ask for at least
one new token). A value out of bounds is the dataclass's own ConfigError, said with the flag's name. A flag
given twice: the last wins (argparse's rule, and parse_overrides' for key=value); a list flag gathers both.
The settings modules import no torch, so a command's --help answers at once. A FlagSet is one class's part
of a command line (cli/main.py's Command records list them), and the rows of its docs table.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, Field, dataclass, fields
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from qkv.config import ConfigError, bounds_text, check_value, field_types

# the settings modules import only the standard library and qkv.config (their packages load the rest on
# first use), so that a command's --help answers at once
from qkv.serve.config import ServeConfig

Rules = Mapping[str, Mapping[str, Any]]
T = TypeVar("T")
__all__ = ["QUANTIZE", "add_flags", "check_flags", "command_table",
           "flag_of", "flags_table", "FlagSet", "option", "read_flags", "read_settings", "spellings",
           "table_rows"]


def option(name: str) -> str:
    """The flag of a field: top_k -> --top-k."""
    return "--" + name.replace("_", "-")


def spellings(f: Field) -> tuple[str, ...]:
    """The flag's spellings of a declared field: its metadata's own (one or several), else option(name)."""
    spelt = f.metadata.get("flag")
    if isinstance(spelt, (str, tuple)):
        return (spelt,) if isinstance(spelt, str) else spelt
    return (option(f.name),)


def flag_of(f: Field) -> str:
    """A field's flag as messages name it (its first spelling), or its metavar for a positional argument."""
    if f.metadata.get("positional"):
        return f.metadata.get("metavar") or f.name.upper()
    return spellings(f)[0]


def _flagged(cls: type, only: Iterable[str] | None) -> list[Field]:
    """The fields of `cls` that get a flag: those named in `only` (in its order), else those declared with a
    flag."""
    if only is None:
        return [f for f in fields(cls) if f.metadata.get("flag")]
    by_name = {f.name: f for f in fields(cls)}
    return [by_name[name] for name in only]


def _flag_type(cls: type, f: Field) -> tuple[type, tuple | None, bool]:
    """(the type of one value, the choices or None, whether the flag takes a list) of `cls`'s field `f`."""
    tp = field_types(cls)[f.name]
    if get_origin(tp) in (Union, types.UnionType):
        tp, *rest = [a for a in get_args(tp) if a is not type(None)]
        if rest:
            raise TypeError(f"{cls.__name__}.{f.name} ({tp} | ...) has no flag type")
    choices = f.metadata.get("choices")
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        return type(choices[0]), choices, False
    if get_origin(tp) in (list, tuple):
        return get_args(tp)[0], choices, True
    return tp, choices, False


def _default(f: Field) -> Any:
    """A field's default value (None for a field without one: its flag is required)."""
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None if f.default is MISSING else f.default


def _rule(f: Field, rules: Rules | None) -> dict[str, Any]:
    """The field's metadata with the command's rules for it over it."""
    return {**f.metadata, **((rules or {}).get(f.name) or {})}


def _described(cls: type, f: Field, default: Any, defaults: Mapping[str, str] | None,
               rules: Rules | None) -> tuple[str, str | None]:
    """(what the setting does with its bounds, what applies when its flag is not given, in words or None
    where nothing is said): a flag's help and a docs table's row."""
    meta = _rule(f, rules)
    text = meta["help"]
    choices = _flag_type(cls, f)[1]
    if choices:
        if not all(str(c) in text for c in choices):
            text += f" ({' or '.join(map(str, choices))})"
    elif bounds_text(meta):
        text += "; " + bounds_text(meta)
        if meta.get("flag_none") is not None:
            text += f", or {meta['flag_none']}: {meta['none']}"
    if defaults and f.name in defaults:
        return text, defaults[f.name]
    return text, str(default) if default is not None else meta.get("none") or None


def add_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
              only: Iterable[str] | None = None, defaults: Mapping[str, str] | None = None,
              rules: Rules | None = None) -> None:
    """A flag for each field of the settings dataclass `cls` declared with a flag (or each named in `only`),
    typed, bounded and helped from the field's declaration; a field declared positional is a positional
    argument (a list: one or more values, or any number where it has a default). `defaults`: per field,
    what applies in this command when the flag is not given, in words (else the dataclass's default);
    `rules`: per field, this command's bounds over the field's own."""
    for f in _flagged(cls, only):
        text, default = _described(cls, f, _default(f), defaults, rules)
        tp, choices, many = _flag_type(cls, f)
        if tp not in (bool, int, float, str, Path):  # a mapping or a nested config: keys only
            raise TypeError(f"{cls.__name__}.{f.name} ({tp}) has no flag type")
        required = f.default is MISSING and f.default_factory is MISSING
        if f.metadata.get("positional"):
            nargs = ("+" if required else "*") if many else None if required else "?"
            p.add_argument(f.name, type=tp, choices=choices, nargs=nargs, default=None,
                           metavar=f.metadata.get("metavar") or None, help=text)
            continue
        text += f" (default: {default})" if default is not None else ""
        if tp is bool:
            p.add_argument(*spellings(f), dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                           required=required, help=text)
        else:  # a list flag given twice gathers both lists (--image a.png --image b.png)
            p.add_argument(*spellings(f), dest=f.name, type=tp, choices=choices, nargs="+" if many else None,
                           action="extend" if many else "store", default=None, required=required,
                           metavar=f.metadata.get("metavar") or None, help=text)


def check_flags(cls: type, given: dict[str, Any], rules: Rules | None = None) -> dict[str, Any]:
    """`given` ({field: value} from flags) checked by `cls`'s bounds (with `rules` over them) and by building
    `cls` of them: a ConfigError said with the flag's name (`--top-p must be in (0, 1], got 2.0`)."""
    by_name = {f.name: f for f in fields(cls)}
    try:
        for name, value in given.items():
            check_value(name, value, _rule(by_name[name], rules))
        cls(**given)
    except ConfigError as e:
        if e.field in given:
            raise e.for_flag(flag_of(by_name[e.field])) from None
        raise
    return given


def read_flags(args: argparse.Namespace, cls: type, *, only: Iterable[str] | None = None,
               rules: Rules | None = None) -> dict[str, Any]:
    """{field: value} of the flags add_flags made for `cls` that were given (None = not given; a flag_none
    value, e.g. --prefill-chunk 0, stands for None), checked (check_flags)."""
    given = {}
    for f in _flagged(cls, only):
        value = getattr(args, f.name, None)
        if value is not None:
            none = f.metadata.get("flag_none")
            given[f.name] = None if none is not None and value == none else value
    return check_flags(cls, given, rules)


def read_settings(args: argparse.Namespace, cls: type[T], *, rules: Rules | None = None) -> T:
    """The settings dataclass `cls` of a command's flags and positional arguments (add_flags(p, cls)): the
    values given, the dataclass's defaults for the rest, checked (check_flags)."""
    return cls(**read_flags(args, cls, rules=rules))


def table_rows(cls: type, *, only: Iterable[str] | None = None, defaults: Mapping[str, str] | None = None,
               rules: Rules | None = None, keys: str | None = None) -> list[str]:
    """The Markdown rows of flags_table for one class."""
    rows = []
    for f in _flagged(cls, only) if keys is None or only is not None else fields(cls):
        text, default = _described(cls, f, _default(f), defaults, rules)
        if keys is not None and f.metadata.get("none") and default != f.metadata["none"]:
            text += f"; null: {f.metadata['none']}"
        if f.default is MISSING and f.default_factory is MISSING:
            default = "required"
        elif f.default_factory is not MISSING and not _default(f):
            default = None  # an empty list
        if keys is not None:
            shown = keys + f.name
        elif f.metadata.get("positional"):
            shown = flag_of(f)
        else:
            shown = "`, `".join(spellings(f))
            shown += f"`, `--no-{spellings(f)[0][2:]}" if _flag_type(cls, f)[0] is bool else ""
        cells = (default or "none", text)  # a | in a cell would end it
        rows.append(f"| `{shown}` | " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return rows


def flags_table(*classes: type, only: Iterable[str] | None = None, defaults: Mapping[str, str] | None = None,
                rules: Rules | None = None, keys: str | None = None) -> str:
    """The Markdown table of the flags add_flags makes for `classes` with these arguments, or with `keys`
    (a section: "train.") of the `section.key=value` settings (the docs hold each command's: a test
    compares)."""
    rows = [f"| {'key' if keys is not None else 'option'} | default | what it does |", "|---|---|---|"]
    for cls in classes:
        names = None if only is None else [n for n in only if n in {f.name for f in fields(cls)}]
        rows += table_rows(cls, only=names, defaults=defaults, rules=rules, keys=keys)
    return "\n".join(rows)


@dataclass(frozen=True)
class FlagSet:
    """The flags one settings dataclass gives a command: add_flags' and flags_table's arguments, once."""

    cls: type
    only: tuple[str, ...] | None = None
    defaults: Mapping[str, str] | None = None
    rules: Rules | None = None

    def add(self, p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        add_flags(p, self.cls, only=self.only, defaults=self.defaults, rules=self.rules)

    def read(self, args: argparse.Namespace) -> dict[str, Any]:
        return read_flags(args, self.cls, only=self.only, rules=self.rules)

    def rows(self) -> list[str]:
        return table_rows(self.cls, only=self.only, defaults=self.defaults, rules=self.rules)


QUANTIZE = FlagSet(ServeConfig, only=("quantize",))  # the commands that load a model for inference


def command_table(flag_sets: Iterable[FlagSet]) -> str:
    """The Markdown table of a command's flags (docs/cli.md holds each command's: a test compares)."""
    rows = ["| option | default | what it does |", "|---|---|---|"]
    return "\n".join(rows + [row for flag_set in flag_sets for row in flag_set.rows()])
