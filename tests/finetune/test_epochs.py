"""--epochs counts the sequences of every rank: under torchrun each update reads batch_size x grad_accum sequences
on each of WORLD_SIZE ranks, so an epoch has that many times fewer updates (both recipes: chat and encoders)."""

from __future__ import annotations

import argparse
import math

import pytest

from qkv.finetune.chat import _train_config
from qkv.finetune.encoders import train_config


def _args(tmp_path, overrides, epochs):
    return argparse.Namespace(overrides=overrides, out=tmp_path, no_progress=True, seed=0, epochs=epochs,
                              resume=False)


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
    enc = train_config(_args(tmp_path, over, 2.0), n_train=n, has_dev=False)
    assert enc.max_steps == 2 * math.ceil(n / per_update)
