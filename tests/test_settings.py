"""One way to declare a setting (qkv.config.setting) and one way to make flags of it (qkv.cli.flags): the
bounds, choices and help declared once are what the dataclass enforces, what the flags take and say, and
what the docs' tables list; an error names the field, and the flag on a command line."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Literal

import pytest

from qkv.cli.flags import add_flags, check_flags, flags_table, read_flags
from qkv.config import ConfigError, bounds_text, check_fields, from_dict, setting


@dataclass
class Toy:
    steps: int = setting(10, "updates", ge=1)
    rate: float = setting(0.5, "a share", gt=0, le=1, note="1 = all")
    wait: float = setting(2.0, "time to wait", ge=0, unit="seconds")
    chunk: int | None = setting(64, "tokens per step", ge=1, none="whole prompts", flag_none=0)
    mode: Literal["fast", "slow"] = setting("fast", "how")
    quant: str | None = setting(None, "packing", choices=("int8", "int4"), none="full precision")
    cache: bool = setting(True, "keep results")
    names: list[str] = setting(["a", "b"], "which ones")
    folder: str = setting("out", "where", flag="--out")
    hidden: int = setting(3, "library only", flag=False)

    def __post_init__(self) -> None:
        check_fields(self)


def _parser(**kw) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toy", exit_on_error=False)
    add_flags(p, Toy, **kw)
    return p


def test_bounds_in_words():
    assert bounds_text({"gt": 0, "le": 1, "note": "1 = all"}) == "in (0, 1] (1 = all)"
    assert bounds_text({"ge": 0, "unit": "seconds"}) == "at least 0 seconds"
    assert bounds_text({"gt": 0}) == "> 0" and bounds_text({"le": 2}) == "<= 2" and bounds_text({}) == ""
    assert bounds_text({"choices": ("int8", "int4"), "ge": 1}) == "one of ('int8', 'int4')"


@pytest.mark.parametrize("kw,field,message", [
    ({"steps": 0}, "steps", "Toy.steps must be at least 1, got 0"),
    ({"rate": 0.0}, "rate", "Toy.rate must be in (0, 1] (1 = all), got 0.0"),
    ({"rate": math.nan}, "rate", "Toy.rate must be a finite number in (0, 1] (1 = all), got nan"),
    ({"wait": math.inf}, "wait", "Toy.wait must be a finite number at least 0 seconds, got inf"),
    ({"wait": -1.0}, "wait", "Toy.wait must be at least 0 seconds, got -1.0"),
    ({"chunk": 0}, "chunk", "Toy.chunk must be at least 1 (or None: whole prompts), got 0"),
    ({"quant": "int3"}, "quant", "Toy.quant must be one of ('int8', 'int4') (or None: full precision), got "
                                 "'int3'"),
    ({"mode": "quick"}, "mode", "Toy.mode: 'quick' is not one of ['fast', 'slow']"),
    ({"steps": "10"}, "steps", "Toy.steps: expected an integer, got '10'"),
])
def test_a_value_out_of_its_declaration_is_one_error_carrying_the_field(kw, field, message):
    with pytest.raises(ConfigError) as e:
        Toy(**kw)
    assert (str(e.value), e.value.field, e.value.where) == (message, field, "Toy")
    assert e.value.named("--x") == "--x" + message[len(f"Toy.{field}"):]
    with pytest.raises(ConfigError) as mapped:  # a mapping (YAML) is checked by the same rule
        from_dict(Toy, kw)
    assert str(mapped.value) == message


def test_defaults_bounds_and_none_pass_and_a_list_default_is_not_shared():
    a, b = Toy(chunk=None, quant="int4", rate=1, steps=1.0), Toy()
    assert (a.rate, a.steps, type(a.steps)) == (1.0, 1, int)  # normalised as from_dict normalises a mapping
    a.names.append("c")
    assert b.names == ["a", "b"]


def test_flags_are_typed_bounded_and_helped_from_the_declaration():
    p = _parser()
    actions = {a.dest: a for a in p._actions}
    assert "hidden" not in actions and actions["folder"].option_strings == ["--out"]
    assert actions["mode"].choices == ("fast", "slow") and actions["quant"].choices == ("int8", "int4")
    assert actions["rate"].help == "a share; in (0, 1] (1 = all) (default: 0.5)"
    assert actions["chunk"].help == "tokens per step; at least 1, or 0: whole prompts (default: 64)"
    assert actions["quant"].help == "packing (int8 or int4) (default: full precision)"
    args = p.parse_args(["--steps", "3", "--no-cache", "--chunk", "0", "--names", "x", "y", "--out", "o",
                         "--steps", "4"])
    assert read_flags(args, Toy) == {"steps": 4, "cache": False, "chunk": None, "names": ["x", "y"],
                                     "folder": "o"}
    assert read_flags(p.parse_args([]), Toy) == {}  # not given: the dataclass decides


def test_only_defaults_and_rules_of_a_command():
    p = _parser(only=("rate", "steps"), defaults={"rate": "the folder's"}, rules={"steps": {"ge": 5}})
    actions = {a.dest: a for a in p._actions}
    assert set(actions) == {"help", "rate", "steps"}
    assert actions["rate"].help.endswith("(default: the folder's)") and "at least 5" in actions["steps"].help
    with pytest.raises(ConfigError, match=r"^--steps must be at least 5, got 4$") as e:
        read_flags(p.parse_args(["--steps", "4"]), Toy, only=("rate", "steps"), rules={"steps": {"ge": 5}})
    assert e.value.field == "steps"


def test_a_flag_out_of_bounds_is_the_dataclasses_error_said_with_the_flag():
    with pytest.raises(ConfigError, match=r"^--rate must be in \(0, 1\] \(1 = all\), got 2.0$"):
        read_flags(_parser().parse_args(["--rate", "2"]), Toy)
    with pytest.raises(ConfigError, match=r"^--out: expected a string, got 3$"):
        check_flags(Toy, {"folder": 3})


def test_the_table_lists_what_the_flags_say():
    table = flags_table(Toy).splitlines()
    assert table[:2] == ["| option | default | what it does |", "|---|---|---|"]
    assert "| `--rate` | 0.5 | a share; in (0, 1] (1 = all) |" in table
    assert "| `--cache`, `--no-cache` | True | keep results |" in table
    assert "| `--quant` | full precision | packing (int8 or int4) |" in table
    assert len(table) == 2 + 9 and not any("hidden" in row for row in table)
    assert flags_table(Toy, only=("steps",), defaults={"steps": "ten"}).splitlines()[2] == (
        "| `--steps` | ten | updates; at least 1 |")


def test_every_settings_dataclass_declares_each_field_with_the_helper():
    from dataclasses import fields

    from qkv.generate.config import GenerationConfig
    from qkv.generate.engine_config import EngineConfig
    from qkv.run import EvalSettings
    from qkv.serve.config import ServeConfig
    from qkv.train import TrainConfig

    for cls in (GenerationConfig, EngineConfig, ServeConfig, TrainConfig, EvalSettings):
        undeclared = [f.name for f in fields(cls) if not f.metadata.get("help")]
        assert not undeclared, (cls.__name__, undeclared)


@pytest.mark.parametrize("section,cls_name,data,field", [
    ("train", "TrainConfig", {"lr": 0.0}, "lr"), ("train", "TrainConfig", {"min_lr": 1.0}, "min_lr"),
    ("train", "TrainConfig", {"warmup": 2.5}, "warmup"),
    ("train", "TrainConfig", {"max_skips": -1}, "max_skips"),
    ("eval", "EvalSettings", {"n": -1}, "n")])
def test_a_run_sections_bad_value_names_its_key(section, cls_name, data, field):
    from qkv.run import EvalSettings
    from qkv.train import TrainConfig

    cls = {"TrainConfig": TrainConfig, "EvalSettings": EvalSettings}[cls_name]
    with pytest.raises(ConfigError) as e:
        from_dict(cls, data, section)
    assert e.value.field == field and field in str(e.value)
