"""A speedrun profile: every setting of every phase, one YAML file under qkv/configs/speedrun/ (package data),
so a user copies one and changes it (`qkv speedrun --profile my.yaml`), or overrides a key on the command
line (`qkv speedrun pretrain.train.max_steps=50`)."""

from __future__ import annotations

import difflib
import os
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from qkv.config import ConfigError, apply_overrides, from_dict, load_yaml, parse_overrides

PROFILE_DIR = "speedrun"  # under qkv/configs
DEFAULT_PROFILE = "cpu"


@dataclass
class DataSettings:
    val_fraction: float = 0.1  # share of modules held out (by a stable hash of the path)
    max_modules: int = 0  # > 0: that many train modules (the smallest), a quarter as many held out; 0 = all


@dataclass
class TokenizerSettings:
    vocab_size: int = 4096  # byte-level BPE: 256 bytes + specials + merges


@dataclass
class PretrainSettings:
    # GPTConfig fields (family gpt): the Llama shape by default, so the model exports as `llama`
    model: dict[str, Any] = field(default_factory=lambda: {
        "d_model": 256, "n_layers": 6, "n_heads": 8, "n_kv_heads": 4, "position": "rope", "norm": "rmsnorm",
        "ffn": "swiglu", "bias": False})
    context: int = 256  # tokens per training window = the model's context length
    train: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields (qkv train's train section)
    eval_windows: int = 200  # held-out windows the final loss / bits per byte are measured on


@dataclass
class SFTSettings:
    epochs: float = 2.0  # passes over the conversations
    lora: bool = False  # LoRA adapters instead of every weight
    lora_rank: int = 16  # with lora: the adapters' rank (alpha = 2 x rank), on every linear layer
    identity_copies: int = 8  # times each identity question is repeated
    synthetic: int = 2000  # arithmetic + spelling conversations
    max_doc_qa: int = 0  # > 0: at most this many doc-QA conversations (0 = all)
    train: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields of the fine-tune


@dataclass
class EvalSettings:
    doc_qa: int = 100  # held-out doc-QA questions
    synthetic: int = 100  # held-out arithmetic / spelling questions
    code: int = 40  # held-out function signatures the base model continues
    few_shot: int = 3  # examples in the base model's doc-QA prompt
    max_new_tokens: int = 48  # longest answer generated
    code_tokens: int = 96  # longest function body generated
    samples: int = 3  # sample chats in the report


@dataclass
class Profile:
    name: str = DEFAULT_PROFILE
    seed: int = 0
    data: DataSettings = field(default_factory=DataSettings)
    tokenizer: TokenizerSettings = field(default_factory=TokenizerSettings)
    pretrain: PretrainSettings = field(default_factory=PretrainSettings)
    sft: SFTSettings = field(default_factory=SFTSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def profile_names() -> list[str]:
    folder = resources.files("qkv") / "configs" / PROFILE_DIR
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def profile_path(name: str) -> Path:
    """A shipped profile's YAML (`quick`), or a YAML file the user wrote."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or os.sep in name:
        if not p.is_file():
            raise ConfigError(f"profile file not found: {name}")
        return p
    shipped = resources.files("qkv") / "configs" / PROFILE_DIR / f"{name}.yaml"
    if not shipped.is_file():
        near = difflib.get_close_matches(name, profile_names(), n=1, cutoff=0.5)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"unknown speedrun profile {name!r}{hint} (profiles: {', '.join(profile_names())}, "
                          "or a YAML file)")
    return Path(str(shipped))


def load_profile(name: str | None = None, overrides: list[str] | None = None) -> Profile:
    """The profile `name` (default cpu) with section.key=value overrides, checked strictly (a misspelt key
    names the closest one)."""
    name = name or DEFAULT_PROFILE
    data = load_yaml(profile_path(name)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"profile {name}: expected a mapping of sections")
    data = apply_overrides(data, parse_overrides(overrides or []), "speedrun profile")
    data.setdefault("name", Path(name).stem)
    return from_dict(Profile, data, "profile")


__all__ = ["DEFAULT_PROFILE", "DataSettings", "EvalSettings", "PretrainSettings", "Profile", "SFTSettings",
           "TokenizerSettings", "load_profile", "profile_names", "profile_path"]
