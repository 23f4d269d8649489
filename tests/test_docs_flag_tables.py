"""Each command's settings table in the docs is the one generated from the dataclass its flags (or its
section.key=value settings) come from, so that a bound, a default or a help text changed in the
declaration cannot leave the docs behind. A failure prints the table to paste."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from qkv.cli.finetune import flags_tables as finetune_tables
from qkv.cli.flags import command_table, flags_table
from qkv.cli.generate import (
    CHAT_DEFAULTS,
    CHAT_FLAGS,
    GENERATE_DEFAULTS,
    GENERATE_FLAGS,
    REQUEST_RULES,
)
from qkv.cli.main import SUBCOMMANDS, build_parser
from qkv.config import TransformerConfig, field_types
from qkv.generate.config import GenerationConfig
from qkv.generate.engine_config import EngineConfig
from qkv.models.detr import DETRConfig
from qkv.models.gpt import GPTConfig
from qkv.models.set_loss import SetLossWeights
from qkv.models.vlm import VLMConfig
from qkv.run import EvalSettings
from qkv.serve.config import ServeConfig
from qkv.tasks import task_names, task_spec
from qkv.tasks.lm import LMOptions
from qkv.tasks.speech import TRAIN_ACCENTS, TRAIN_VARIANTS, TRAIN_VOICES, SpeechOptions
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
# a task's default that a table cell cannot show as it is, in words
TASK_DEFAULTS = {
    LMOptions: {"sample_prompt": "a newline"},
    SpeechOptions: {"train_voices": f"{len(TRAIN_VOICES)} voices: {len(TRAIN_ACCENTS)} accents x "
                                    f"{len(TRAIN_VARIANTS)} variants"},
}
TASKS: dict[type, list[str]] = {}  # every registered task's options class, with the tasks it serves
for _name in task_names():
    TASKS.setdefault(task_spec(_name).options_class, []).append(_name)
for _cls, _names in TASKS.items():
    TABLES[f"task: {', '.join(_names)}"] = (
        "docs/tasks.md", lambda cls=_cls: flags_table(cls, keys="task.", defaults=TASK_DEFAULTS.get(cls)))


@pytest.mark.parametrize("command", list(TABLES))
def test_the_docs_table_is_the_generated_one(command):
    doc, table = TABLES[command]
    text = (ROOT / doc).read_text(encoding="utf-8")
    assert table() in text, f"{doc}: the table of {command} is not the generated one:\n{table()}"


@pytest.mark.parametrize("name", [name for name in SUBCOMMANDS if name != "finetune"])
def test_docs_cli_holds_every_commands_generated_table(name):
    """docs/cli.md: each command's section holds the table of every flag and argument the command takes
    (finetune's, per recipe, are docs/finetune.md's, compared above)."""
    text = (ROOT / "docs/cli.md").read_text(encoding="utf-8")
    table = command_table(SUBCOMMANDS[name].flag_sets())
    section = text.split(f"## qkv {name}\n", 1)[-1].split("\n## ", 1)[0]
    assert table in section, f"docs/cli.md: the table of qkv {name} is not the generated one:\n{table}"


def test_every_flag_of_a_command_is_in_its_table():
    """The tables cover the whole command line: each option string argparse knows (but --help) is in its
    command's table, so a flag added by hand beside the dataclasses would show here."""
    for name, command in SUBCOMMANDS.items():
        parser = build_parser([name])
        sub = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == name)[1]
        table = finetune_tables() if name == "finetune" else command_table(command.flag_sets())
        for action in sub._actions:
            for flag in action.option_strings:
                assert flag in ("-h", "--help") or f"`{flag}`" in table, f"qkv {name} {flag}"
