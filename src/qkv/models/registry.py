"""Name registries: families (config class + model class) and named presets."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from qkv.config import ConfigError, from_dict, replace, to_dict


@dataclass(frozen=True)
class Family:
    name: str
    config_class: type
    model_class: type

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.model_class.kinds


# What a family is, for the tasks and the run builder: tasks branch on kinds, never on family names, so a new
# family of a known kind serves every task of that kind unchanged. A family declares its kinds (main first)
# as the ClassVar `kinds` of its model class.
KINDS = (
    "decoder",  # token ids -> next-token logits (GPT; the LSTM in mode lm)
    "seq2seq",  # token ids -> token ids through an encoder and a cross-attending decoder (EncoderDecoder)
    "encoder",  # token ids -> hidden states, MLM logits or a class (BERT; the LSTM in mode classify)
    "image",  # pixels -> a class (ViT, Swin)
    "audio",  # a waveform -> token ids (Whisper)
    "dual",  # two towers mapping images and texts into one space (CLIP)
    "detection",  # pixels -> a set of (class, box) pairs (DETR)
)

_FAMILIES: dict[str, Family] = {}
_PRESETS: dict[str, tuple[str, Any, str]] = {}  # name -> (family, config, one-line description)


def register_family(name: str, config_class: type, model_class: type) -> None:
    kinds = getattr(model_class, "kinds", ())
    if not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"family {name!r}: {model_class.__name__}.kinds must be a non-empty tuple of "
                         f"{KINDS}, got {kinds!r}")
    _FAMILIES[name] = Family(name, config_class, model_class)
    model_class.family = name
    model_class.config_class = config_class


def register_preset(name: str, family_name: str, config: Any, description: str = "") -> None:
    _PRESETS[name] = (family_name, config, description)


def family(name: str) -> Family:
    if name not in _FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; known: {sorted(_FAMILIES)}")
    return _FAMILIES[name]


def families() -> list[str]:
    return sorted(_FAMILIES)


def presets() -> list[str]:
    return sorted(_PRESETS)


def preset(name: str) -> tuple[Family, Any, str]:
    if name not in _PRESETS:
        match = difflib.get_close_matches(name, list(_PRESETS), n=1, cutoff=0.4)
        hint = f"; did you mean {match[0]!r}?" if match else f"; known presets: {', '.join(sorted(_PRESETS))}"
        raise ConfigError(f"unknown preset {name!r}{hint}")
    fam, cfg, desc = _PRESETS[name]
    return _FAMILIES[fam], cfg, desc


def config_for(name_or_config: Any, **overrides: Any) -> tuple[Family, Any]:
    """Resolve a preset name, a config object, or a mapping {'family': ..., **fields} to (family, config)."""
    if isinstance(name_or_config, str):
        fam, cfg, _ = preset(name_or_config)
    elif isinstance(name_or_config, dict):
        data = dict(name_or_config)
        base = data.pop("preset", None)
        fam_name = data.pop("family", None)
        if base is not None:
            fam, cfg, _ = preset(base)
            if fam_name is not None and fam_name != fam.name:
                raise ConfigError(f"preset {base!r} is a {fam.name} model, not {fam_name}")
            cfg = replace(cfg, **data)
        elif fam_name is not None:
            fam = family(fam_name)
            cfg = from_dict(fam.config_class, data)
        else:
            raise ConfigError("a model config needs 'preset' or 'family'")
    else:
        matches = [f for f in _FAMILIES.values() if type(name_or_config) is f.config_class]
        if not matches:
            raise ConfigError(f"{type(name_or_config).__name__} is not a registered model config")
        fam, cfg = matches[0], from_dict(type(name_or_config), to_dict(name_or_config))
    if overrides:
        cfg = replace(cfg, **overrides)
    return fam, cfg


def build(name_or_config: Any, **overrides: Any) -> Any:
    """A freshly initialised model from a preset name or a config, with keyword overrides."""
    fam, cfg = config_for(name_or_config, **overrides)
    return fam.model_class(cfg)
