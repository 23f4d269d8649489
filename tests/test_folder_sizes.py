"""A qkv model folder whose config.json asks for sizes its weights do not have (n_layers 10**9, vocab_size
10**12,
...) is one CheckpointError naming the field, raised before the model is built on a real device: no test here
allocates the memory such a config describes (the guard below fails any real build instead)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import qkv
import qkv.checkpoint as checkpoint
from qkv.checkpoint import CONFIG_NAME, CheckpointError, load_model, save_model
from qkv.cli.main import main

GPT = {"family": "gpt", "vocab_size": 19, "n_layers": 2, "d_model": 16, "n_heads": 2, "context_length": 8}
ENCDEC = {"family": "encdec", "src_vocab_size": 19, "n_encoder_layers": 1, "n_decoder_layers": 1,
          "d_model": 16, "n_heads": 2, "d_ff": 32, "context_length": 8, "position": "rope"}


@pytest.fixture
def no_real_build(monkeypatch):
    """Every model class the folder loader builds refuses to be built anywhere but on the meta device."""
    real = checkpoint.family

    def family(name):
        fam = real(name)

        class Guarded(fam.model_class):
            def __init__(self, config):
                assert (torch.empty(0).device.type
                        == "meta"), "built for real from a config.json its file does not fit"
                super().__init__(config)

        return dataclasses.replace(fam, model_class=Guarded)

    monkeypatch.setattr(checkpoint, "family", family)


def _folder(tmp_path, spec: dict, **edits) -> str:
    folder = save_model(qkv.build(spec), tmp_path / "m")
    meta = json.loads((folder / CONFIG_NAME).read_text())
    for dotted, value in edits.items():
        section = meta["config"]
        *parents, leaf = dotted.split("__")
        for p in parents:
            section = section[p]
        section[leaf] = value
    (folder / CONFIG_NAME).write_text(json.dumps(meta))
    return str(folder)


@pytest.mark.parametrize("spec, edits, message", [
    (GPT, {"n_layers": 10**9},
     r"config.json: n_layers is 1000000000, but .*model.safetensors holds \d+ tensors"),
    (GPT, {"moe__n_experts": 10**9}, r"config.json: moe.n_experts is 1000000000, but .* holds \d+ tensors"),
    (ENCDEC, {"n_decoder_layers": 10**9}, r"n_decoder_layers is 1000000000, but .* holds \d+ tensors"),
    (GPT, {"vocab_size": 10**12}, r"config.json: vocab_size is 1000000000000, but .*model.safetensors has "
                                  r"tok_emb.weight of shape \(19, 16\) \(vocab_size would be 19\)"),
    (GPT, {"context_length": 10**10}, r"context_length is 10000000000, but .* of shape \(8, 16\) "
                                      r"\(context_length would be 8\)"),
    (GPT, {"d_model": 10**9},
     r"config.json: describes tensors too large for any machine \(d_model is 1000000000\)"),
    (ENCDEC, {"d_model": 10**6}, r"config.json: d_model is 1000000, but .* \(d_model would be 16\)"),
    (ENCDEC, {"d_model": 10**6, "d_ff": 10**6},
     r"config.json: d_ff / d_model are 1000000, but .* of shape \(16,\) "
     r"\(d_ff / d_model would be 16\)"),
])
def test_sizes_the_weights_do_not_have_are_refused_before_the_build(tmp_path, no_real_build, spec, edits,
                                                                    message):
    folder = _folder(tmp_path, spec, **edits)
    with pytest.raises(CheckpointError, match=message):
        load_model(folder)


def test_what_no_weight_shows_is_weighed_against_the_memory(tmp_path, no_real_build, monkeypatch):
    """A RoPE table is computed, not stored: a context_length of 10**8 would allocate ~38 GB of tables for a
    model whose weights take kilobytes. Against the machine's memory (1 GiB here) it is one error naming
    it."""
    monkeypatch.setattr("qkv.folder_sizes.memory_bytes", lambda: 2**30)
    folder = _folder(tmp_path, {**GPT, "position": "rope"}, context_length=10**8)
    with pytest.raises(CheckpointError,
                       match=r"config.json: the model it describes needs [\d.]+ GiB, more than this "
                             r"machine's 1.0 GiB of memory: its decoder.position.\w+ alone is "
                             r"\(100000000, \d+\) \(context_length is 100000000\)"):
        load_model(folder)


def test_a_fitting_folder_loads_as_before(tmp_path):
    model = qkv.build({**GPT, "position": "rope"}).eval()
    loaded = load_model(save_model(model, tmp_path / "m")).eval()
    ids = torch.randint(0, 19, (1, 8))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    # an edit that still fits the weights (context_length may differ for RoPE) loads too
    edited = _folder(tmp_path / "e", {**GPT, "position": "rope"}, context_length=32)
    assert load_model(edited).config.context_length == 32


def test_the_cli_says_it_in_one_line(tmp_path, no_real_build, capsys):
    folder = _folder(tmp_path, GPT, vocab_size=10**12)
    assert main(["info", folder]) == 2
    err = capsys.readouterr().err
    assert (err.startswith("qkv: error: ") and "vocab_size is 1000000000000" in err
            and len(err.splitlines()) == 1)
