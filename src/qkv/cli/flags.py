"""Command-line flags generated from the settings dataclasses, so that no bound or help text is written twice.

    add_generation_flags(p, ("max_new_tokens", "temperature", "top_k", "top_p"))   # --max-new-tokens ...
    generation_flags(args, names)   # {field: value} of the flags given, checked by GenerationConfig

Each flag is named after its GenerationConfig field (`top_k` -> `--top-k`), typed after it, defaults to None
(not given: the task's, the folder's or the file's value stands) and takes its help and its bounds from the
field's metadata (generate/config.py). A value out of bounds is GenerationConfig's own ConfigError, said with
the flag's name. A flag given twice: the last wins (argparse's rule, and parse_overrides' for key=value).
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from qkv.config import ConfigError

_TYPES = {"int": int, "float": float, "int | None": int, "float | None": float}


def option(name: str) -> str:
    """The flag of a field: top_k -> --top-k."""
    return "--" + name.replace("_", "-")


def add_generation_flags(p: argparse.ArgumentParser, names: tuple[str, ...],
                         defaults: dict[str, str] | None = None) -> None:
    """One flag per named numeric GenerationConfig field. `defaults` says, per field, what applies when the
    flag is not given in this command (the only text written here)."""
    from qkv.generate.config import REQUEST_AT_LEAST, GenerationConfig, bounds_text

    by_name = {f.name: f for f in fields(GenerationConfig)}
    for name in names:
        f = by_name[name]
        kind = _TYPES.get(str(f.type))
        if kind is None:
            raise TypeError(f"GenerationConfig.{name} ({f.type}) is not a numeric setting")
        bounds = f"at least {REQUEST_AT_LEAST[name]}" if name in REQUEST_AT_LEAST else bounds_text(f)
        text = f.metadata["help"] + (f"; {bounds}" if bounds else "")
        if defaults and name in defaults:
            text += f" (default: {defaults[name]})"
        p.add_argument(option(name), type=kind, default=None, help=text)


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


QUANTIZE_MODES = ("int8", "int4")  # qkv.nn.quant.MODES, written out: the CLI imports torch only when it runs


def add_quantize(p: argparse.ArgumentParser) -> None:
    """--quantize, shared by the commands that load a model for inference (generate, chat, serve, explore)."""
    p.add_argument("--quantize", choices=QUANTIZE_MODES, default=None,
                   help="weight-only quantized projections and output head for inference: int8 (per output "
                        "channel) or int4 (per group of 64 inputs); fastest with a bf16 model (docs/llm.md)")
