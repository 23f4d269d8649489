"""Typed, strict configuration: dataclasses in, YAML in, dotted `key=value` overrides.

Unknown keys are an error naming the closest valid key; values are type-checked against the field's
annotation. Configs stay plain data (no objects), so they serialise to JSON/YAML and rebuild a model.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A wrong key or value in a configuration (printed as one line by the CLI). Raised about one setting, it
    carries the setting's `field` (and the config it is in, `where`) and its `problem`, the words after the
    setting's name: the CLI says it with the flag's name instead (named)."""

    def __init__(self, message: str, field: str | None = None, where: str | None = None) -> None:
        self.problem, self.field, self.where = message, field, where
        super().__init__(message if field is None else self.named(f"{where}.{field}" if where else field))

    def named(self, name: str) -> str:
        """The message with the setting called `name` ("--top-p must be in (0, 1], got 1.5")."""
        return f"{name}{'' if self.problem[:1] in (':', '[') else ' '}{self.problem}"

    def for_flag(self, flag: str) -> ConfigError:
        """This error, about the setting the command-line flag `flag` gave."""
        error = ConfigError(self.problem, self.field, self.where)
        error.args = (self.named(flag),)
        return error


def setting(default: Any = MISSING, help: str = "", *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None, choices: tuple | None = None, note: str = "",
            none: str = "", unit: str = "", flag: bool | str | tuple[str, ...] = True, flag_none: Any = None,
            positional: bool = False, metavar: str = "") -> Any:
    """A settings dataclass's field, declared once: its default (a list or dict is copied for each instance),
    `help` text, bounds (ge / gt / le / lt), `choices` (where the annotation is no Literal), what a boundary
    value means (`note`: "0 = greedy"), what None means (`none`), the `unit` of its value, whether a command's
    flags include it (`flag`: True, False, or the flag's own spellings), the flag value that stands for None
    (`flag_none`: 0 for --prefill-chunk), whether it is a command's positional argument and the name its
    value is shown by (`metavar`). check_fields enforces the bounds and choices, qkv.cli.flags builds the
    flags and the docs' tables of it."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "note": note,
            "none": none, "unit": unit, "flag": flag, "flag_none": flag_none, "positional": positional,
            "metavar": metavar}
    if isinstance(default, (list, dict, set)) or dataclasses.is_dataclass(default):  # a nested config too
        return dataclasses.field(default_factory=functools.partial(copy.deepcopy, default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def bounds_text(meta: Mapping[str, Any]) -> str:
    """What a setting's value must be, in words: "in (0, 1]", "at least 0 (0 = greedy)", "at least 0
    seconds", "one of ('int8', 'int4')"; "" for a setting without bounds or choices."""
    ge, gt, le, lt, note, unit = (meta.get(k) for k in ("ge", "gt", "le", "lt", "note", "unit"))
    if meta.get("choices"):
        return f"one of {tuple(meta['choices'])}"
    low = f"[{ge}" if ge is not None else f"({gt}" if gt is not None else None
    high = f"{le}]" if le is not None else f"{lt})" if lt is not None else None
    if low is not None and high is not None:
        text = f"in {low}, {high}"
    elif low is not None:
        text = f"at least {ge}" if ge is not None else f"> {gt}"
    else:
        text = f"<= {le}" if le is not None else f"< {lt}" if lt is not None else ""
    text += f" {unit}" if unit and text else ""
    return f"{text} ({note})" if note and text else text


def check_value(name: str, value: Any, meta: Mapping[str, Any], where: str | None = None,
                optional: bool = True) -> None:
    """`value` of the setting `name` inside its bounds and choices (`meta`: its field's metadata, or a
    command's rules over it), or None where None has a meaning (`optional`); else a ConfigError about that
    field."""
    ge, gt, le, lt, choices = (meta.get(k) for k in ("ge", "gt", "le", "lt", "choices"))
    if (value is None and optional) or (not choices and (ge, gt, le, lt) == (None,) * 4):
        return
    if choices:
        ok = value in choices
    else:
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
              and (ge is None or value >= ge) and (gt is None or value > gt) and (le is None or value <= le)
              and (lt is None or value < lt))
    if not ok:
        none = f" (or None: {meta['none']})" if meta.get("none") else ""
        finite = "a finite number " if isinstance(value, float) and not math.isfinite(value) else ""
        raise ConfigError(f"must be {finite}{bounds_text(meta)}{none}, got {value!r}", name, where)


def suggest(name: object, valid: list[str], what: str = "valid keys") -> str:
    """The tail of an error message about an unknown `name`: the closest of `valid`, or all of them listed as
    `what` ("; did you mean 'lr'?" / "; known tasks: a, b")."""
    match = difflib.get_close_matches(str(name), valid, n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else f"; {what}: {', '.join(sorted(valid))}"


def _coerce(value: Any, tp: Any, where: str | None, name: str) -> Any:
    """Check `value` of the field `name` of `where` against annotation `tp` (int, float, bool, str, Optional,
    Literal, list, dict, a nested dataclass)."""
    def bad(problem: str) -> ConfigError:
        return ConfigError(f": {problem}", field=name, where=where)

    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where, name)
            except ConfigError as e:
                errors.append(e)
        raise errors[0] if errors else bad(f"bad value {value!r}")
    if origin is Literal:
        if value not in get_args(tp):
            raise bad(f"{value!r} is not one of {list(get_args(tp))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad(f"expected a list, got {value!r}")
        (item,) = get_args(tp)[:1] or (Any,)
        return [_coerce(v, item, where, name) for v in value]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise bad(f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise bad(f"expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise bad(f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 (PyYAML) reads 1e-3 (no dot) as a string, not a float
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, os.PathLike):  # a Path for a folder field (TrainConfig(out_dir=Path(...)))
            return os.fspath(value)
        if not isinstance(value, str):
            raise bad(f"expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise bad(f"expected a mapping, got {value!r}")
        return from_dict(tp, value, f"{where}.{name}" if where else name)
    return value


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """typing.get_type_hints, once per class: it evaluates every string annotation again on each call (~ms
    for a config of many fields; the serving engine builds a GenerationConfig per request)."""
    return typing.get_type_hints(cls)


def from_dict(cls: type[T], data: dict[str, Any], where: str | None = None) -> T:
    """Build dataclass `cls` from a mapping, rejecting unknown keys and ill-typed values."""
    where = where or cls.__name__
    hints = field_types(cls)
    names = [f.name for f in fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"unknown key {key!r} in {where}{suggest(key, names)}")
        kwargs[key] = _coerce(value, hints[key], where, key)
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{where}: {e}") from None
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate()
    return obj


def check_fields(cfg: Any, where: str | None = None) -> None:
    """Every field of the dataclass `cfg` holds a value of its annotation's type (checked as from_dict checks
    a mapping: a Literal typo or a "10" for an int is the same ConfigError either way), inside the bounds and
    choices its metadata declares (setting); normalises in place what from_dict would (an int field's 10.0
    -> 10, a tuple -> list). `where` names the config in messages (default its class; "" for none)."""
    where = type(cfg).__name__ if where is None else where
    hints = field_types(type(cfg))
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        checked = _coerce(value, hints[f.name], where or None, f.name)
        if checked is not value:
            setattr(cfg, f.name, checked)
        check_value(f.name, checked, f.metadata, where or None)


def check_bounds(cfg: Any, where: str | None = None) -> None:
    """Every field of the dataclass `cfg` inside the bounds and choices its metadata declares: check_fields
    without the type check (for a config built for each request from values already typed)."""
    where = type(cfg).__name__ if where is None else where
    hints = field_types(type(cfg))
    for f in fields(cfg):
        optional = type(None) in get_args(hints[f.name])
        check_value(f.name, getattr(cfg, f.name), f.metadata, where or None, optional)


def memory_bytes() -> int | None:
    """The machine's physical memory, where the platform says it (None where it does not)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def replace(cfg: T, **overrides: Any) -> T:
    """A copy of `cfg` with overrides, checked like from_dict (nested keys as dotted names). A mapping given
    for a nested config sets the keys it names and keeps the others, as the dotted names do:
    `model.vision.d_model=32` on the command line arrives as {"vision": {"d_model": 32}} and must not reset
    the rest of the tower."""
    data = to_dict(cfg)
    for key, value in _dotted_items(cfg, overrides):
        _set_dotted(data, key, value, type(cfg).__name__)
    return from_dict(type(cfg), data)


def _dotted_items(cfg: Any, overrides: dict[str, Any], prefix: str = "") -> Any:
    for key, value in overrides.items():
        sub = functools.reduce(lambda node, name: getattr(node, name, None), key.split("."), cfg)
        if isinstance(value, dict) and dataclasses.is_dataclass(sub):
            yield from _dotted_items(sub, value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _set_dotted(data: dict[str, Any], dotted: str, value: Any, where: str) -> None:
    parts = dotted.split(".")
    node = data
    for p in parts[:-1]:
        if p not in node or not isinstance(node[p], dict):
            raise ConfigError(f"unknown key {dotted!r} in {where}{suggest(p, [k for k in node])}")
        node = node[p]
    node[parts[-1]] = value


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """['a.b=3', 'c=rope'] -> {'a.b': 3, 'c': 'rope'}; values are parsed as YAML scalars. A key given twice:
    the last wins, as a flag given twice does in argparse (appending to a script's command line overrides
    it)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        except RecursionError:  # PyYAML's parser recurses once per nesting level
            raise ConfigError(f"override {key.strip()!r}: the value is nested too deeply") from None
        out[key.strip()] = value
    return out


def _written(items: list[str], key: str) -> str:
    """The key=value item that set `key` on the command line (the last one: it wins)."""
    return [o.strip() for o in items if "=" in o and o.split("=", 1)[0].strip() == key][-1]


def check_flag_keys(pairs: list[tuple[str, Any, str]], overrides: list[str],
                    values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The one flag-vs-`key=value` rule: a flag and the key it is a shortcut for are one setting, so both on
    the command line with different values is one error naming the two (the same form given twice is not a
    conflict: the last wins, argparse's rule for flags and parse_overrides' for keys). `pairs` are (flag,
    its value or None when not given, dotted key); `values` maps a key to the override's value in the flag's
    terms (default: the parsed override itself). A key ending in out_dir compares as a path (./o is o).
    Returns the parsed overrides."""
    given = parse_overrides(overrides)
    theirs = given if values is None else values
    for flag, value, key in pairs:
        if value is None or key not in theirs:
            continue
        if key.endswith("out_dir"):
            same = Path(str(theirs[key])).resolve() == Path(str(value)).resolve()
        else:
            same = theirs[key] == value
        if not same:
            shown = "" if isinstance(value, bool) else f" {value}"
            raise ConfigError(f"{flag}{shown} and {_written(overrides, key)} disagree; give one of them")
    return given


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any], where: str = "config") -> dict[str, Any]:
    """Set dotted keys in a nested dict (creating intermediate mappings); validation happens in from_dict."""
    for key, value in overrides.items():
        parts = key.split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{where}: {key!r} goes through a non-mapping value")
        node[parts[-1]] = value
    return data


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:  # PyYAML's parser recurses once per nesting level
        raise ConfigError(f"{p}: nested too deeply to be a run config") from None
    except yaml.YAMLError as e:  # one line: PyYAML's message spans several, with a "<unicode string>" mark
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{p}: not valid YAML{where} ({problem})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping")
    return data


@dataclass
class TransformerConfig:
    """Fields every family's blocks share (each model config extends this). The choices of ffn, norm,
    placement, position and attention are the names qkv.nn defines (checked by validate: nn/ is the one
    place a variant lives, so a new one is one table entry there)."""

    d_model: int = setting(256, "width of the residual stream", ge=1)
    n_heads: int = setting(4, "attention heads; head_dim = d_model // n_heads", ge=1)
    n_kv_heads: int | None = setting(None, "key/value heads (GQA/MQA); divides n_heads", ge=1, none="n_heads")
    d_ff: int | None = setting(None, "feed-forward hidden size", ge=1, none="4 * d_model")
    ffn: str = setting("gelu", "feed-forward activation: relu, gelu, gelu_tanh, swiglu, silu, geglu_tanh or "
                       "quick_gelu (qkv.nn.ffn.ACTIVATIONS)")
    norm: str = setting("layernorm", "layernorm, rmsnorm or batchnorm")
    norm_eps: float = setting(1e-5, "the norms' epsilon", ge=0)
    placement: str = setting("pre", "pre (x + f(norm(x))) or post (norm(x + f(x)))")
    position: str = setting("learned", "none, sinusoidal, learned, rope, alibi or relative")
    rope_base: float = setting(10000.0, "RoPE's base (theta)", gt=0)
    attention: str = setting("fused", "naive (returns weights) or fused (torch SDPA / flash)")
    scaled: bool = setting(True, "multiply q.k by 1/sqrt(d_k); false is the ablation")
    bias: bool = setting(True, "biases in linears and norms")
    dropout: float = setting(0.0, "residual / embedding dropout", ge=0, lt=1)
    attn_dropout: float = setting(0.0, "dropout on attention probabilities", ge=0, lt=1)
    init_std: float = setting(0.02, "std of the normal init of linears and embeddings", ge=0)
    embed_init_std: float | None = setting(None, "std for embeddings (the seeds' 'init 1.0 -> NaN' "
                                           "ablation)", ge=0, none="init_std")
    # variants of released decoder models (Llama, Qwen2/3, Mistral); the defaults are the plain blocks
    head_dim: int | None = setting(None, "attention head width when n_heads * head_dim != d_model", ge=1,
                                   none="d_model // n_heads")
    qkv_bias: bool | None = setting(None, "biases on the q/k/v projection only (Qwen2)", none="follow bias")
    qk_norm: bool = setting(False, "RMSNorm over each head's queries and keys before RoPE (Qwen3)")
    rope_scaling: dict[str, Any] | None = setting(None, '{"rope_type": "linear" or "llama3", "factor": ...}',
                                                  none="plain RoPE")
    sliding_window: int | None = setting(None, "attention span (Mistral): longer sequences are refused, "
                                         "not truncated", ge=1, none="no window")

    @classmethod
    def override(cls, name: str, default: Any) -> Any:
        """The setting `name` of this config declared again in a subclass with another default, its help and
        bounds kept (a dataclass field re-declared with a bare default would lose them)."""
        return setting(default, **{f.name: f for f in fields(cls)}[name].metadata)

    def validate(self) -> None:
        from qkv.nn.attention import BACKENDS
        from qkv.nn.block import PLACEMENTS
        from qkv.nn.ffn import ACTIVATIONS
        from qkv.nn.norm import NORMS
        from qkv.nn.position import ENCODINGS, rope_inv_freq

        check_fields(self)
        name = type(self).__name__
        for field_name, choices in [("ffn", ACTIVATIONS), ("norm", NORMS), ("placement", PLACEMENTS),
                                    ("position", ENCODINGS), ("attention", BACKENDS)]:
            value = getattr(self, field_name)
            if value not in choices:
                raise ConfigError(f": {value!r} is not one of {list(choices)}"
                                  + suggest(value, list(choices), "choices"), field_name, name)
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ConfigError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                              f"({self.n_kv_heads})")
        if self.position == "rope" and (self.head_dim or self.d_model // self.n_heads) % 2:
            raise ConfigError("position=rope needs an even head dimension (head_dim or d_model // n_heads)")
        if self.rope_scaling is not None:
            try:
                rope_inv_freq(2, 10000.0, self.rope_scaling)
            except (KeyError, TypeError, ValueError) as e:
                raise ConfigError(f"{self.rope_scaling}: {e!r}", "rope_scaling", name) from None

    def block_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of nn.Block taken from this config."""
        return dict(
            d_ff=self.d_ff, n_kv_heads=self.n_kv_heads, ffn=self.ffn, norm=self.norm, norm_eps=self.norm_eps,
            placement=self.placement, dropout=self.dropout, attn_dropout=self.attn_dropout, bias=self.bias,
            attention=self.attention, scaled=self.scaled, head_dim=self.head_dim, qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
        )

    def layer_kwargs(self, layer: int) -> dict[str, Any]:
        """Keyword arguments of nn.Block that differ per layer (a family with MoE blocks adds `moe`)."""
        return {}
