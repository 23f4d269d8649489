"""`qkv generate` without --seed samples with a new seed each run and says it on stderr (two runs gave the
same text: the seed defaulted to 0); --seed N repeats a run; greedy decoding and the Python API say
nothing."""

from __future__ import annotations

import re

from qkv.cli.main import build_parser, main
from qkv.run import generate_text

ANNOUNCED = re.compile(r"qkv: sampling with seed (\d+) \(--seed \1 repeats it\)\n")


def test_unseeded_sampling_differs_between_runs_and_prints_the_seed_that_repeats_it(tiny_lm_run, capsys):
    args = ["generate", str(tiny_lm_run[0]), "--prompt", "ab", "--max-new-tokens", "40"]
    outs, seeds = [], []
    for _ in range(2):
        assert main(args) == 0
        cap = capsys.readouterr()
        said = ANNOUNCED.fullmatch(cap.err)
        assert said, cap.err
        outs.append(cap.out)
        seeds.append(said.group(1))
    assert seeds[0] != seeds[1] and outs[0] != outs[1]
    assert main([*args, "--seed", seeds[0]]) == 0  # the printed seed repeats the first run
    cap = capsys.readouterr()
    assert cap.out == outs[0] and cap.err == ""  # a seed the user gave is not announced


def test_greedy_and_the_api_say_no_seed(tiny_lm_run, capsys):
    folder = str(tiny_lm_run[0])
    assert main(["generate", folder, "--prompt", "ab", "--max-new-tokens", "5", "--greedy"]) == 0
    assert capsys.readouterr().err == ""
    # the library keeps its default seed 0: one call, one answer
    assert generate_text(folder, "ab", max_new_tokens=20) == generate_text(folder, "ab", max_new_tokens=20)
    assert capsys.readouterr().err == ""


def test_the_help_says_what_the_seed_defaults_to():
    help_text = " ".join(build_parser(["generate"])._subparsers._group_actions[0].choices["generate"]
                         .format_help().split())
    assert "--seed SEED seed of the sampling (default: a new one each run, printed on stderr to repeat it)" \
        in help_text
