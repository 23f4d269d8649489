"""The sampling flags of `qkv generate` / `qkv chat` are generated from GenerationConfig's fields (one place
for their bounds and help), temperature 0 is greedy there as in the API, a flag given twice keeps the last
value, and a flag and its key=value with different values are one error."""

from __future__ import annotations

from dataclasses import fields

import pytest

from qkv.cli.flags import CLI_AT_LEAST, check_generation, option
from qkv.cli.generate import CHAT_FLAGS, GENERATE_FLAGS
from qkv.cli.main import build_parser, main
from qkv.config import ConfigError, check_flag_keys, parse_overrides
from qkv.generate import GenerationConfig
from qkv.generate.config import bounds_text


def _subparser_help(command: str) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser([command, "-h"]).parse_args([command, "-h"])
    return out.getvalue()


@pytest.mark.parametrize("command,names", [("generate", GENERATE_FLAGS), ("chat", CHAT_FLAGS)])
def test_flag_help_and_bounds_come_from_generation_config(command, names):
    text = " ".join(_subparser_help(command).split())
    by_name = {f.name: f for f in fields(GenerationConfig)}
    for name in names:
        f = by_name[name]
        assert option(name) in text
        assert " ".join(f.metadata["help"].split()) in text, name
        bounds = f"at least {CLI_AT_LEAST[name]}" if name in CLI_AT_LEAST else bounds_text(f)
        assert bounds in text, (name, bounds)


@pytest.mark.parametrize("name,value", [("temperature", -0.5), ("temperature", float("nan")), ("top_k", -1),
                                        ("top_p", 0.0), ("top_p", 1.5), ("num_beams", 0),
                                        ("no_repeat_ngram_size", -2), ("max_new_tokens", 0)])
def test_a_flag_out_of_range_is_generation_configs_error_with_the_flags_name(name, value):
    if name not in CLI_AT_LEAST:  # the library refuses it too, with the same words
        with pytest.raises(ConfigError, match=f"GenerationConfig.{name} must be"):
            GenerationConfig(**{name: value})
    with pytest.raises(ConfigError, match=f"^{option(name)} must be"):
        check_generation({name: value})


def test_temperature_zero_accepted_everywhere():
    assert not GenerationConfig(do_sample=True, temperature=0).sampling
    check_generation({"temperature": 0.0})  # no error


def test_temperature_zero_on_the_cli_equals_greedy_generation_config(tiny_lm_run, capsys):
    from qkv.run import generate_text

    folder, _, _ = tiny_lm_run
    assert main(["generate", str(folder), "--prompt", "ab", "--max-new-tokens", "8", "--temperature", "0",
                 "--sample", "--seed", "3"]) == 0
    cli = capsys.readouterr().out.rstrip("\n")
    lib = generate_text(str(folder), "ab", GenerationConfig(do_sample=False, max_new_tokens=8))
    assert cli == lib and len(cli) > len("ab")


def test_a_flag_given_twice_keeps_the_last_as_a_key_given_twice_does():
    argv = ["generate", "x", "--temperature", "0.5", "--temperature", "0"]
    args = build_parser(["generate"]).parse_args(argv)
    assert args.temperature == 0.0
    assert parse_overrides(["train.lr=0.001", "train.lr=0.002"]) == {"train.lr": 0.002}


def test_a_flag_and_its_key_that_disagree_are_one_error():
    pairs = [("--seed", 1, "train.seed"), ("--out", "o", "train.out_dir")]
    assert check_flag_keys(pairs, ["train.seed=1", "train.out_dir=./o"])["train.seed"] == 1  # agree
    with pytest.raises(ConfigError, match=r"^--seed 1 and train.seed=2 disagree; give one of them$"):
        check_flag_keys(pairs, ["train.seed=2"])
    with pytest.raises(ConfigError, match="--out o and train.out_dir=p disagree"):
        check_flag_keys(pairs, ["train.out_dir=p"])
    assert check_flag_keys([("--seed", None, "train.seed")], ["train.seed=2"]) == {"train.seed": 2}


def test_train_and_finetune_say_a_conflict_alike(tmp_path, capsys):
    assert main(["train", "charlm", "--seed", "1", "train.seed=2", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "qkv: error: --seed 1 and train.seed=2 disagree; give one of them"
    assert not (tmp_path / "r").exists()
