"""The sampling flags of `qkv generate` / `qkv chat` are generated from GenerationConfig's fields (one place
for their bounds and help), temperature 0 is greedy there as in the API, a flag given twice keeps the last
value, and a flag and its key=value with different values are one error."""

from __future__ import annotations

from dataclasses import fields

import pytest

from qkv.cli.flags import check_flags, option
from qkv.cli.generate import CHAT_FLAGS, GENERATE_FLAGS, REQUEST_RULES
from qkv.cli.main import build_parser, main
from qkv.config import ConfigError, bounds_text, check_flag_keys, parse_overrides
from qkv.generate import GenerationConfig
from qkv.generate.config import REQUEST_AT_LEAST


def check_generation(given: dict) -> None:
    check_flags(GenerationConfig, given, REQUEST_RULES)


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
        bounds = f"at least {REQUEST_AT_LEAST[name]}" if name in REQUEST_AT_LEAST else bounds_text(f.metadata)
        if f.metadata["choices"]:  # argparse's choices, each named in the help
            assert all(str(c) in f.metadata["help"] for c in f.metadata["choices"])
        else:
            assert bounds in text, (name, bounds)


@pytest.mark.parametrize("name,value", [("temperature", -0.5), ("temperature", float("nan")), ("top_k", -1),
                                        ("top_p", 0.0), ("top_p", 1.5), ("num_beams", 0),
                                        ("no_repeat_ngram_size", -2), ("max_new_tokens", 0)])
def test_a_flag_out_of_range_is_generation_configs_error_with_the_flags_name(name, value):
    if name not in REQUEST_AT_LEAST:  # the library refuses it too, with the same words
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


@pytest.mark.parametrize("flag,value,message", [
    ("--temperature", -1.0, "--temperature must be at least 0 (0, or below 1e-05, = greedy), got -1.0"),
    ("--top-p", 1.5, "--top-p must be in (0, 1], got 1.5"),
    ("--top-k", -2, "--top-k must be at least 0 (0 = no top-k), got -2")])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_bad_sampling_flag_exits_2_with_generation_configs_message(command, flag, value, message, tmp_path,
                                                                     capsys):
    name = flag[2:].replace("-", "_")
    with pytest.raises(ConfigError) as err:  # the library's own words, the flag named in place of the field
        GenerationConfig(**{name: value})
    assert str(err.value) == message.replace(flag, f"GenerationConfig.{name}")
    # the folder does not exist: the flag is refused before anything is loaded
    argv = [command, str(tmp_path / "absent"), flag, str(value)]
    argv += ["--prompt", "a"] if command == "generate" else ["--message", "hi"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"qkv: error: {message}"


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """A random two-layer Qwen2 with a ChatML tokenizer.json: what `qkv chat` loads."""
    transformers = pytest.importorskip("transformers")
    import pydoc_data.topics

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(pydoc_data.topics.topics.values())[:20], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
    path = tmp_path_factory.mktemp("chat")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, initializer_range=0.3, eos_token_id=0,
                                      tie_word_embeddings=True)
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def test_temperature_zero_in_chat_equals_greedy(chat_folder, capsys):
    base = ["chat", str(chat_folder), "--message", "hi", "--max-new-tokens", "8"]
    assert main([*base, "--greedy"]) == 0
    greedy = capsys.readouterr().out
    assert main([*base, "--temperature", "0", "--top-k", "5", "--seed", "3"]) == 0
    assert capsys.readouterr().out == greedy and greedy.strip()
    assert main([*base, "--temperature", "0", "--top-k", "5", "--seed", "4"]) == 0
    assert capsys.readouterr().out == greedy
