"""Exporting into a folder that holds a sharded model (its own source folder, an earlier sharded save) used to
leave the old model.safetensors.index.json and its shards beside the new model.safetensors: two sets of
weights, the old one read by any tool that follows the index or globs model*.safetensors. An export now
replaces them as it replaces a single model.safetensors, and touches nothing else."""

from __future__ import annotations

import json
import os

import pytest
import torch

import qkv

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _sharded_gpt2(folder):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder, max_shard_size="20KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (folder / "model.safetensors").exists()  # really sharded
    return shards


def _changed(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25 * torch.randn_like(p))
    return model.eval()


def test_exporting_over_a_sharded_hf_folder_leaves_one_set_of_weights(tmp_path):
    from qkv.interop.gpt2 import export_gpt2

    folder = tmp_path / "gpt2"
    shards = _sharded_gpt2(folder)
    (folder / "README.md").write_text("notes")  # not weights: stays
    # a weights-like name the index does not list: stays
    (folder / "model-extra.safetensors").write_bytes(b"x")
    before = set(os.listdir(folder))
    model = _changed(qkv.from_pretrained(folder))
    export_gpt2(model, folder)
    left = set(os.listdir(folder))
    assert left == (before - set(shards) - {"model.safetensors.index.json"}) | {"model.safetensors"}
    # the folder is the exported model, in transformers (the reference) and in qkv
    ids = torch.randint(0, 50, (2, 10))
    with torch.no_grad():
        want = model(ids).logits
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
        again = qkv.from_pretrained(folder).eval()(ids).logits
    torch.testing.assert_close(hf, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, want, atol=1e-5, rtol=1e-5)


def test_a_qkv_save_over_a_sharded_folder_replaces_it_too(tmp_path):
    folder = tmp_path / "gpt2"
    shards = _sharded_gpt2(folder)
    model = _changed(qkv.from_pretrained(folder))
    model.save_pretrained(folder)
    assert (not any((folder / s).exists() for s in shards)
            and not (folder / "model.safetensors.index.json").exists())
    ids = torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(qkv.from_pretrained(folder).eval()(ids).logits, model(ids).logits)


def test_only_plain_weight_files_the_index_names_are_removed(tmp_path):
    from qkv.storage import remove_replaced_shards

    folder = tmp_path / "m"
    folder.mkdir()
    outside = tmp_path / "outside.safetensors"
    for p in (outside, folder / "a-00001-of-00002.safetensors", folder / "a-00002-of-00002.safetensors",
              folder / "notes.txt", folder / "model.safetensors", folder / "pytorch_model.bin",
              folder / "w-00001-of-00001.bin"):
        p.write_bytes(b"x")
    (folder / "sub").mkdir()
    (folder / "sub" / "x.safetensors").write_bytes(b"x")
    weight_map = {"a": "a-00001-of-00002.safetensors", "b": "a-00002-of-00002.safetensors",
                  "c": "../outside.safetensors", "d": "notes.txt", "e": "model.safetensors",
                  "f": "sub/x.safetensors", "g": "missing-00001-of-00001.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {
        "a": "w-00001-of-00001.bin"}}))
    removed = remove_replaced_shards(folder)
    assert sorted(removed) == sorted(["a-00001-of-00002.safetensors", "a-00002-of-00002.safetensors",
                                      "model.safetensors.index.json", "w-00001-of-00001.bin",
                                      "pytorch_model.bin.index.json"])
    assert sorted(os.listdir(folder)) == ["model.safetensors", "notes.txt", "pytorch_model.bin", "sub"]
    assert outside.exists() and (folder / "sub" / "x.safetensors").exists()


def test_an_index_that_is_not_json_goes_alone(tmp_path):
    from qkv.storage import remove_replaced_shards

    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"x")
    assert remove_replaced_shards(tmp_path) == ["model.safetensors.index.json"]
    assert (tmp_path / "model-00001-of-00001.safetensors").exists()
