"""A qkv finetune flag that stands for a Trainer setting (--batch-size, --lr, --seed, --resume, --no-progress,
--out) and its train.key=value override are one setting: either may be given, and both with different values
are one error naming the two. seq2seq used to let train.batch_size / train.lr silently beat its flags,
train.resume=true was refused with 'pass --resume', train.seed changed the Trainer's seed but not the data
order's, and train.out_dir sent the checkpoints away from --out."""

from __future__ import annotations

import argparse

import pytest

import qkv.finetune as ft
from qkv.cli.finetune import add_finetune, read_settings
from qkv.cli.main import main

pytest.importorskip("transformers")
pytest.importorskip("sacrebleu")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

COMMON = ("train.plot=false", "train.tensorboard=false")


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    from test_seq2seq_recipe import _t5_folder

    return _t5_folder(tmp_path_factory.mktemp("t5") / "t5")


def _data(tmp_path):
    from test_seq2seq_recipe import _pairs, _words

    return _pairs(tmp_path / "d.tsv", _words(8, 0))


@pytest.mark.parametrize("flags, message", [
    (["--batch-size", "4", "train.batch_size=8"],
     "--batch-size 4 and train.batch_size=8 disagree; give one of them"),
    (["--lr", "1e-3", "train.lr=2e-3"], "--lr 0.001 and train.lr=2e-3 disagree; give one of them"),
    (["--seed", "1", "train.seed=2"], "--seed 1 and train.seed=2 disagree; give one of them"),
    (["--no-progress", "train.progress=true"],
     "--no-progress and train.progress=true disagree; give one of them"),
    (["train.out_dir=elsewhere"], "train.out_dir=elsewhere disagree; give one of them"),
])
def test_a_flag_and_its_override_that_disagree_are_one_error(t5, tmp_path, capsys, monkeypatch, flags,
                                                             message):
    monkeypatch.chdir(tmp_path)  # train.out_dir=elsewhere would be written here
    capsys.readouterr()
    rc = main(["finetune", str(t5), "--task", "seq2seq", "--data", str(_data(tmp_path)), "--out",
               str(tmp_path / "o"), "--epochs", "1", *COMMON, *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("qkv: error: ") and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists() and not (tmp_path / "elsewhere").exists()


def test_the_same_value_both_ways_is_fine_and_the_override_alone_counts(t5, tmp_path, capsys):
    """8 pairs: at 4 a batch one epoch is 2 updates (at the default 16 it would be 1)."""
    data = _data(tmp_path)
    for i, flags in enumerate((["--batch-size", "4", "train.batch_size=4"], ["train.batch_size=4"],
                               ["--batch-size", "4"])):
        capsys.readouterr()
        assert main(["finetune", str(t5), "--task", "seq2seq", "--data", str(data), "--out",
                     str(tmp_path / f"o{i}"),
                     "--epochs", "1", "--no-progress", *COMMON, *flags]) == 0, capsys.readouterr().err
        assert "(1 epochs, 2 steps)" in capsys.readouterr().out


def test_train_resume_true_continues_like_the_flag(t5, tmp_path, capsys):
    data, out = _data(tmp_path), tmp_path / "o"
    base = ["finetune", str(t5), "--task", "seq2seq", "--data", str(data), "--out", str(out), "--no-progress",
            *COMMON]
    assert main([*base, "train.max_steps=1"]) == 0
    capsys.readouterr()
    rc = main([*base, "train.max_steps=2", "train.resume=true"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err  # was: "--out ... already holds a fine-tuning run; pass --resume"
    assert "resumed from" in captured.err and "at step 1" in captured.err, captured.err
    assert "2 steps" in captured.out


def _settings(tmp_path, recipe, *argv):
    p = argparse.ArgumentParser()
    add_finetune(p)
    args = p.parse_intermixed_args([str(tmp_path), "--data", "d", "--out", "o", *argv])
    return read_settings(args, ft.recipes()[recipe])


@pytest.mark.parametrize("recipe", ["seq2seq", "classify", "chat"])
def test_the_override_alone_sets_what_the_recipe_reads(tmp_path, recipe):
    """What every recipe reads before the Trainer (the data order's and the new head's seed, check_out's
    resume, the progress bar) comes from its settings: an override alone must set it there."""
    s = _settings(tmp_path, recipe, "train.seed=7", "train.resume=true", "train.progress=false")
    assert (s.seed, s.resume, s.progress) == (7, True, False)
    s = _settings(tmp_path, recipe)
    assert (s.seed, s.resume, s.progress) == (0, False, True)  # the defaults
    if recipe == "seq2seq":
        s = _settings(tmp_path, recipe, "train.batch_size=5", "train.lr=1e-2")
        assert (s.batch_size, s.lr) == (5, 1e-2)


def test_an_override_of_the_wrong_type_is_one_error(tmp_path):
    from qkv.config import ConfigError

    with pytest.raises(ConfigError, match="train.seed='abc': expected int"):
        _settings(tmp_path, "classify", "train.seed=abc")


def test_recipes_that_do_not_run_under_torchrun_say_so_before_anything(t5, tmp_path, capsys, monkeypatch):
    """Under torchrun every rank of the classify / tag / seq2seq recipes evaluated and exported into OUT at
    once (and under FSDP crashed after training); only the chat recipe divides the work (rank 0 writes). The
    others are now refused on every rank before anything is read or written, as their docs say."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    capsys.readouterr()
    rc = main(["finetune", str(t5), "--task", "seq2seq", "--data", str(_data(tmp_path)), "--out",
               str(tmp_path / "o"), "--epochs", "1", *COMMON])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--task seq2seq does not run under torchrun yet (only --task chat does)" in err, err
    assert not (tmp_path / "o").exists()
    assert {r.name for r in ft.recipes().values() if r.distributed} == {"chat"}
