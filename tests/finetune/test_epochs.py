"""--epochs counts the sequences of every rank: under torchrun each update reads batch_size x grad_accum
sequences on each of WORLD_SIZE ranks, so an epoch has that many times fewer updates (every recipe: one
helper, after the train.key=value overrides)."""

from __future__ import annotations

import math

import pytest

from qkv.finetune.chat import ChatSettings, _train_config
from qkv.finetune.classify import ClassifySettings
from qkv.finetune.encoders import FINETUNE_DEFAULTS
from qkv.finetune.recipe import epoch_config
from qkv.train.config import train_overrides


def _args(tmp_path, overrides, epochs, cls=ChatSettings):
    return cls(model="m", data="d", out=tmp_path, progress=False, epochs=epochs,
               train=train_overrides(overrides))


@pytest.mark.parametrize("world, accum", [(None, 1), (2, 1), (2, 2), (3, 1)])
def test_an_epoch_is_all_ranks_sequences(tmp_path, monkeypatch, world, accum):
    if world is not None:  # what torchrun sets in every rank
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("RANK", "0")
    else:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        monkeypatch.delenv("RANK", raising=False)
    n = 9
    over = ["train.batch_size=2", f"train.grad_accum={accum}"]
    per_update = 2 * accum * (world or 1)
    chat = _train_config(_args(tmp_path, over, 1.0), n_train=n, n_dev=0, lora=False)
    assert chat.max_steps == math.ceil(n / per_update)
    enc = epoch_config(_args(tmp_path, over, 2.0, ClassifySettings), FINETUNE_DEFAULTS, n_train=n,
                       has_dev=False)
    assert enc.max_steps == 2 * math.ceil(n / per_update)


@pytest.mark.parametrize("over, steps",
                         [([], 1), (["train.batch_size=4"], 4),
                          (["train.batch_size=4", "train.grad_accum=2"], 2)])
def test_seq2seq_epochs_follow_the_batch_overrides(tmp_path, capsys, monkeypatch, over, steps):
    """seq2seq turned --epochs into steps with its --batch-size (16) even when train.batch_size /
    train.grad_accum changed the batch the Trainer reads: 16 pairs at 4 a batch are 4 updates an epoch, not
    1."""
    pytest.importorskip("transformers")
    from test_seq2seq_recipe import _pairs, _t5_folder, _words

    from qkv.cli.main import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = _t5_folder(tmp_path / "t5")
    data = _pairs(tmp_path / "d.tsv", _words(16, 0))
    capsys.readouterr()
    assert main(["finetune", str(model), "--task", "seq2seq", "--data", str(data), "--out",
                 str(tmp_path / "o"),
                 "--epochs", "1", "--no-progress", "train.plot=false", "train.tensorboard=false", *over]) == 0
    assert f"(1 epochs, {steps} steps)" in capsys.readouterr().out
