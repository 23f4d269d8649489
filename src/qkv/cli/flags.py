"""Command-line flags generated from settings dataclasses (fields declared with qkv.config.setting), so that
no bound, choice or help text is written twice:

    add_flags(p, ServeConfig)                      # a flag for each field declared with flag=True
    add_flags(p, GenerationConfig, only=("top_k", "top_p"), rules={"top_k": {"ge": 1}})
    given = read_flags(args, ServeConfig)          # {field: value} of the flags given, checked
    flags_table(ServeConfig, EngineConfig)         # the Markdown table of docs/serving.md (a test compares)

Each flag is named after its field (`top_k` -> `--top-k`, or the spelling its `flag` metadata gives), typed
after its annotation (a Literal's values or the `choices` are the flag's choices; a bool is --X / --no-X; a
list takes several values), defaults to None (not given: the task's, the folder's, the file's or the
dataclass's value stands) and takes its help and bounds from the metadata. `rules` lays a command's own
bounds over a field's (a request must ask for at least one new token). A value out of bounds is the
dataclass's own ConfigError, said with the flag's name. A flag given twice: the last wins (argparse's rule,
and parse_overrides' for key=value). The settings modules import no torch, so a command's --help answers at
once.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, Field, fields
from typing import Any, Literal, Union, get_args, get_origin

from qkv.config import ConfigError, bounds_text, check_value, field_types

# the settings modules import only the standard library and qkv.config (their packages load the rest on
# first use), so that a command's --help answers at once
from qkv.serve.config import QUANTIZE_MODES, ServeConfig

Rules = Mapping[str, Mapping[str, Any]]
__all__ = ["QUANTIZE_MODES", "add_flags", "add_quantize", "check_flags", "flag_of", "flags_table", "option",
           "read_flags"]


def option(name: str) -> str:
    """The flag of a field: top_k -> --top-k."""
    return "--" + name.replace("_", "-")


def flag_of(f: Field) -> str:
    """The flag of a declared field: its metadata's own spelling, else option(name)."""
    spelt = f.metadata.get("flag")
    return spelt if isinstance(spelt, str) else option(f.name)


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
    typed, bounded and helped from the field's declaration. `defaults`: per field, what applies in this
    command when the flag is not given, in words (else the dataclass's default); `rules`: per field, this
    command's bounds over the field's own."""
    for f in _flagged(cls, only):
        text, default = _described(cls, f, _default(f), defaults, rules)
        text += f" (default: {default})" if default is not None else ""
        tp, choices, many = _flag_type(cls, f)
        if tp not in (bool, int, float, str):  # a mapping or a nested config: keys only
            raise TypeError(f"{cls.__name__}.{f.name} ({tp}) has no flag type")
        required = f.default is MISSING and f.default_factory is MISSING
        if tp is bool:
            p.add_argument(flag_of(f), dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                           required=required, help=text)
        else:
            p.add_argument(flag_of(f), dest=f.name, type=tp, choices=choices, nargs="+" if many else None,
                           default=None, required=required, help=text)


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


def flags_table(*classes: type, only: Iterable[str] | None = None, defaults: Mapping[str, str] | None = None,
                rules: Rules | None = None, keys: str | None = None) -> str:
    """The Markdown table of the flags add_flags makes for `classes` with these arguments, or with `keys`
    (a section: "train.") of the `section.key=value` settings (the docs hold each command's: a test
    compares)."""
    rows = [f"| {'key' if keys is not None else 'option'} | default | what it does |", "|---|---|---|"]
    for cls in classes:
        names = None if only is None else [n for n in only if n in {f.name for f in fields(cls)}]
        for f in _flagged(cls, names) if keys is None or only is not None else fields(cls):
            text, default = _described(cls, f, _default(f), defaults, rules)
            if keys is not None and f.metadata.get("none") and default != f.metadata["none"]:
                text += f"; null: {f.metadata['none']}"
            shown = flag_of(f) + (f"`, `--no-{flag_of(f)[2:]}" if _flag_type(cls, f)[0] is bool else "")
            rows.append(f"| `{shown if keys is None else keys + f.name}` | {default or 'none'} | {text} |")
    return "\n".join(rows)


def add_quantize(p: argparse.ArgumentParser) -> None:
    """--quantize, shared by the commands that load a model for inference (generate, chat, serve, explore):
    ServeConfig's field."""
    add_flags(p, ServeConfig, only=("quantize",))
