"""Each command's settings table in the docs is the one generated from the dataclass its flags (or its
section.key=value settings) come from, so that a bound, a default or a help text changed in the
declaration cannot leave the docs behind. A failure prints the table to paste."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from qkv.cli.flags import flags_table
from qkv.cli.generate import (
    CHAT_DEFAULTS,
    CHAT_FLAGS,
    GENERATE_DEFAULTS,
    GENERATE_FLAGS,
    REQUEST_RULES,
)
from qkv.config import TransformerConfig, field_types
from qkv.generate.config import GenerationConfig
from qkv.generate.engine_config import EngineConfig
from qkv.models.detr import DETRConfig
from qkv.models.gpt import GPTConfig
from qkv.models.set_loss import SetLossWeights
from qkv.models.vlm import VLMConfig
from qkv.run import EvalSettings
from qkv.serve.config import ServeConfig
from qkv.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def own_keys(cls: type) -> list[str]:
    """A model config's own scalar keys: neither TransformerConfig's (their table is shared) nor a nested
    config (a section of its own: `backbone.`, `vision.`)."""
    shared = {f.name for f in fields(TransformerConfig)} if issubclass(cls, TransformerConfig) else set()
    nested = {name for name, tp in field_types(cls).items() if is_dataclass(tp)}
    return [f.name for f in fields(cls) if f.name not in shared | nested]


TABLES = {
    "qkv serve": ("docs/serving.md", lambda: flags_table(ServeConfig, EngineConfig)),
    "qkv generate": ("docs/llm.md", lambda: flags_table(GenerationConfig, only=GENERATE_FLAGS,
                                                          defaults=GENERATE_DEFAULTS, rules=REQUEST_RULES)),
    "qkv chat": ("docs/llm.md", lambda: flags_table(GenerationConfig, only=CHAT_FLAGS, defaults=CHAT_DEFAULTS,
                                                      rules=REQUEST_RULES)),
    "train:": ("docs/training.md", lambda: flags_table(TrainConfig, keys="train.")),
    "eval:": ("docs/training.md", lambda: flags_table(EvalSettings, keys="eval.")),
    "model:": ("docs/training.md", lambda: flags_table(TransformerConfig, keys="model.")),
    "model: (gpt)": ("docs/training.md", lambda: flags_table(GPTConfig, keys="model.",
                                                             only=own_keys(GPTConfig))),
    "model: (llava)": ("docs/vlm.md", lambda: flags_table(VLMConfig, keys="model.",
                                                          only=own_keys(VLMConfig))),
    "model: (detr)": ("docs/detection.md", lambda: flags_table(DETRConfig, keys="model.",
                                                               only=own_keys(DETRConfig))),
    "model.loss: (detr)": ("docs/detection.md", lambda: flags_table(SetLossWeights, keys="model.loss.")),
}


@pytest.mark.parametrize("command", list(TABLES))
def test_the_docs_table_is_the_generated_one(command):
    doc, table = TABLES[command]
    text = (ROOT / doc).read_text(encoding="utf-8")
    assert table() in text, f"{doc}: the table of {command} is not the generated one:\n{table()}"
