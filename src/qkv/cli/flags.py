"""Command-line flags generated from the settings dataclasses, so that no bound or help text is written twice.

    add_generation_flags(p, ("max_new_tokens", "temperature", "top_k", "top_p"))   # --max-new-tokens ...
    generation_flags(args, names)   # {field: value} of the flags given, checked by GenerationConfig

    add_config_flags(p, ServeConfig); config_flags(args, ServeConfig)   # any settings dataclass (qkv serve)

Each flag is named after its field (`top_k` -> `--top-k`), typed after it, defaults to None (not given: the
task's, the folder's, the file's or the dataclass's value stands) and takes its help and its bounds from the
field's metadata (generate/config.py, generate/engine_config.py: `setting`). A value out of bounds is the
dataclass's own ConfigError, said with the flag's name. A flag given twice: the last wins (argparse's rule,
and parse_overrides' for key=value). The settings modules import no torch, so a command's --help answers at
once.
"""

from __future__ import annotations

import argparse
from dataclasses import Field, fields
from typing import Any

# the settings modules import only the standard library and qkv.config (their packages load the rest on
# first use), so that a command's --help answers at once
from qkv.config import ConfigError
from qkv.generate import config as generation_config
from qkv.generate import engine_config
from qkv.serve import config as serve_config


def option(name: str) -> str:
    """The flag of a field: top_k -> --top-k."""
    return "--" + name.replace("_", "-")


def add_generation_flags(p: argparse.ArgumentParser, names: tuple[str, ...],
                         defaults: dict[str, str] | None = None) -> None:
    """One flag per named numeric GenerationConfig field. `defaults` says, per field, what applies when the
    flag is not given in this command (the only text written here)."""
    m = generation_config
    by_name = {f.name: f for f in fields(m.GenerationConfig)}
    for name in names:
        f = by_name[name]
        if engine_config.kind(f) not in ("int", "float"):
            raise TypeError(f"GenerationConfig.{name} ({f.type}) is not a numeric setting")
        at_least = m.REQUEST_AT_LEAST
        bounds = f"at least {at_least[name]}" if name in at_least else m.bounds_text(f)
        text = f.metadata["help"] + (f"; {bounds}" if bounds else "")
        if defaults and name in defaults:
            text += f" (default: {defaults[name]})"
        p.add_argument(option(name), type=_flag_type(f), default=None, help=text)


def generation_flags(a: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    """{field: value} of the flags given (None = not given), each checked by GenerationConfig's own rule:
    an out-of-range value is a ConfigError naming the flag."""
    given = {n: getattr(a, n) for n in names if getattr(a, n, None) is not None}
    check_generation(given)
    return given


def check_generation(given: dict[str, Any]) -> None:
    """Build a GenerationConfig of `given` alone, its error said with the flag's name (`--top-p must be in
    (0, 1], got 2.0`)."""
    from qkv.generate.config import REQUEST_AT_LEAST, GenerationConfig

    for name, value in given.items():  # one field at a time: the error names the flag that broke the rule
        if name in REQUEST_AT_LEAST and value < REQUEST_AT_LEAST[name]:
            raise ConfigError(f"{option(name)} must be at least {REQUEST_AT_LEAST[name]}, got {value}")
        try:
            GenerationConfig(**{name: value})
        except ConfigError as e:
            raise ConfigError(str(e).replace(f"GenerationConfig.{name}", option(name))) from None


QUANTIZE_MODES: tuple[str, ...] = serve_config.QUANTIZE_MODES


def _flag_type(f: Field) -> type:
    kind = engine_config.kind(f)
    if kind not in ("int", "float", "str"):
        raise TypeError(f"{f.name} ({f.type}) has no flag type")
    return {"int": int, "float": float, "str": str}[kind]


def _described(f: Field, default: Any) -> tuple[str, str]:
    """(what the setting does with its bounds, its default in words): the flag's help and docs' table row."""
    m = engine_config
    text = f.metadata["help"]
    if m.kind(f) in ("int", "float") and not f.metadata.get("choices"):
        text += "; " + m.must_text(f).split(" (or None")[0]
        if f.metadata.get("flag_none") is not None:
            text += f", or {f.metadata['flag_none']}: {f.metadata['none']}"
    choices = f.metadata.get("choices") or ()
    if not all(str(c) in text for c in choices):
        text += f" ({' or '.join(map(str, choices))})"
    return text, str(default) if default is not None else f.metadata.get("none") or "none"


def add_setting_flag(p: argparse.ArgumentParser, f: Field, default: Any = None) -> None:
    """The flag of one declared setting (engine_config.setting): typed after the field, its choices, its help
    and bounds from the metadata, `default` (the dataclass's) in the help; a bool is --X / --no-X. The flag's
    own default is None: not given, the dataclass's default stands."""
    text, default_text = _described(f, default)
    text += f" (default: {default_text})"
    if engine_config.kind(f) == "bool":
        p.add_argument(option(f.name), action=argparse.BooleanOptionalAction, default=None, help=text)
    else:
        p.add_argument(option(f.name), type=_flag_type(f), choices=f.metadata.get("choices"), default=None,
                       help=text)


def flags_table(*classes: type) -> str:
    """The Markdown table of the flags of `classes` (docs/serving.md holds `qkv serve`'s: a test compares)."""
    rows = ["| option | default | what it does |", "|---|---|---|"]
    for cls in classes:
        defaults = cls()
        for f in fields(cls):
            if f.metadata.get("flag"):
                text, default_text = _described(f, getattr(defaults, f.name))
                names = option(f.name)
                if engine_config.kind(f) == "bool":
                    names += f"`, `--no-{f.name.replace('_', '-')}"
                rows.append(f"| `{names}` | {default_text} | {text} |")
    return "\n".join(rows)


def add_config_flags(p: argparse.ArgumentParser, cls: type) -> None:
    """A flag for each field of the settings dataclass `cls` declared with flag=True."""
    defaults = cls()
    for f in fields(cls):
        if f.metadata.get("flag"):
            add_setting_flag(p, f, getattr(defaults, f.name))


def config_flags(a: argparse.Namespace, cls: type) -> dict[str, Any]:
    """{field: value} of `cls`'s flags given (a flag_none value, e.g. --prefill-chunk 0, stands for None),
    checked by building `cls` of them: a ConfigError naming the flag (`--block-size must be a positive
    integer, got 0`)."""
    given = {}
    for f in fields(cls):
        value = getattr(a, f.name, None) if f.metadata.get("flag") else None
        if value is not None:
            none = f.metadata.get("flag_none")
            given[f.name] = None if none is not None and value == none else value
    try:
        cls(**given)
    except ConfigError as e:
        name = str(e).split(" ", 1)[0]
        raise ConfigError(str(e).replace(name, option(name), 1) if name in given else str(e)) from None
    return given


def add_quantize(p: argparse.ArgumentParser) -> None:
    """--quantize, shared by the commands that load a model for inference (generate, chat, serve, explore):
    ServeConfig's field."""
    cls = serve_config.ServeConfig
    add_setting_flag(p, next(f for f in fields(cls) if f.name == "quantize"))
