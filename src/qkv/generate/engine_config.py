"""EngineConfig: the continuous-batching Engine's settings in one validated dataclass (engine.py reads it).

    Engine(model, cfg, config=EngineConfig(block_size=16, max_batch_size=32))
    Engine(model, cfg, block_size=16, max_batch_size=32)        # the same: keywords build an EngineConfig

Each field is declared once, with its help text and bounds in its metadata (`setting`): validate(), the
`qkv serve` flags (qkv.cli.flags) and the docs read it. This module imports only the standard library and
qkv.generate.config (itself torch-free), so that the CLI can build its flags without loading torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import Field, dataclass, field, fields
from typing import Any

from qkv.config import ConfigError
from qkv.generate.config import bounds_text

PREEMPTION = ("least_work", "newest")  # victim policies (scheduler.py)


def setting(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, choices: tuple | None = None, none: str = "", unit: str = "",
            flag: bool = True, flag_none: Any = None) -> Any:
    """A field with its help text, bounds (ge / gt / le, as GenerationConfig's), `choices`, what None means
    (`none`), the `unit` of its value, whether `qkv serve` has a flag for it, and the flag value that stands
    for None (`flag_none`: 0 for --prefill-chunk, whose None has no spelling on a command line)."""
    return field(default=default, metadata={"help": help, "ge": ge, "gt": gt, "le": le, "choices": choices,
                                            "none": none, "unit": unit, "flag": flag, "flag_none": flag_none})


def kind(f: Field) -> str:
    """The base type of a setting's annotation: "int", "float", "bool" or "str" (None allowed or not)."""
    return str(f.type).replace(" | None", "").replace("None | ", "")


def must_text(f: Field) -> str:
    """What a setting's value must be, in words: "a positive integer (or None: whole prompts)"."""
    ge, gt, le, unit = (f.metadata.get(k) for k in ("ge", "gt", "le", "unit"))
    if f.metadata.get("choices"):
        text = f"one of {f.metadata['choices']}"
    elif kind(f) == "bool":
        text = "true or false"
    elif kind(f) == "int":
        text = ("a positive integer" if (ge == 1 or gt == 0) and le is None
                else f"an integer {bounds_text(f)}".rstrip())
    elif (ge is not None or gt is not None) and le is None:
        text = f">= {ge}" if ge is not None else f"> {gt}"
    else:
        text = bounds_text(f) or "a number"
    text += f" {unit}" if unit else ""
    return text + (f" (or None: {f.metadata['none']})" if f.metadata.get("none") else "")


def _fits(f: Field, v: Any) -> bool:
    ge, gt, le, choices = (f.metadata.get(k) for k in ("ge", "gt", "le", "choices"))
    if choices:
        return v in choices
    k = kind(f)
    if k == "bool":
        return isinstance(v, bool)
    if k == "str":
        return isinstance(v, str)
    number = int if k == "int" else (int, float)
    return (isinstance(v, number) and not isinstance(v, bool) and math.isfinite(v)
            and (ge is None or v >= ge) and (gt is None or v > gt) and (le is None or v <= le))


def check_settings(cfg: Any) -> None:
    """Every declared field of `cfg` (flag=True or typed int / float / bool / str) holds a value of its kind
    inside its bounds, or None where None has a meaning: else one ConfigError (a ValueError) naming the field
    as `name must be <must_text>, got <value>`."""
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if kind(f) not in ("int", "float", "bool", "str") or (v is None and "None" in str(f.type)):
            continue
        if not _fits(f, v):
            raise ConfigError(f"{f.name} must be {must_text(f)}, got {v!r}")


@dataclass
class EngineConfig:
    block_size: int = setting(16, "positions per KV-cache block", ge=1)
    num_blocks: int | None = setting(None, "KV-cache blocks", ge=1,
                                     none="max_batch_size sequences of the context")
    max_batch_size: int = setting(32, "requests decoded together", ge=1)
    prefill_chunk: int | None = setting(1024, "prompt tokens fed per engine step", ge=1, none="whole prompts",
                                        flag_none=0)
    prefix_caching: bool = setting(True, "share the cached blocks of common prompt prefixes (off: "
                                         "recompute them)")
    preemption: str = setting("least_work", "which request gives its blocks back when the pool runs out",
                              choices=PREEMPTION)
    # "auto": None where the paged step reads K/V in place, else 4096 (Engine resolves it on its cache)
    split_cost: int | str | None = setting(
        "auto", "cost of one more decoding forward, in rows x positions gathered, when the batch is cut "
        "into groups of similar length (None: one forward)", flag=False)
    max_model_len: int | None = setting(
        None, "most prompt + output tokens a request may ask for", ge=1,
        none="the model's configured context (max_position_embeddings: RoPE / ALiBi have no hard limit)")
    image_cache: int = setting(32, "projected image embeddings kept by content hash, so a repeated image "
                               "skips the vision tower (0: none kept)", ge=0, le=4096)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_settings(self)
        s = self.split_cost
        if not (s is None or s == "auto" or (isinstance(s, int) and not isinstance(s, bool))):
            raise ConfigError(f"split_cost must be an int, None or 'auto', got {s!r}")

    @classmethod
    def merged(cls, config: EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
        """`config` (default: the defaults) with the options that name its fields over it; those options are
        taken out of `options` (Engine's other keywords are generation settings)."""
        if config is not None and not isinstance(config, cls):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        names = {f.name for f in fields(cls)}
        mine = {k: options.pop(k) for k in list(options) if k in names}
        base = config if config is not None else cls()
        return dataclasses.replace(base, **mine) if mine else base
