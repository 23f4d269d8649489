"""The HF loaders fail with one clear CheckpointError naming the culprit: a missing key, an unexpected key,
a wrong shape, an unknown model_type, absent weights, a pickle that is not a plain state dict. Also the
generic pieces of qkv.interop.common (map expansion, q/k/v concatenation, transforms) on small inputs."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

import qkv  # noqa: E402
from qkv.checkpoint import CheckpointError  # noqa: E402
from qkv.interop.common import convert_state, expand, export_state  # noqa: E402


def _gpt2_folder(path):
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    return path


def _edit_weights(path, fn):
    f = path / "model.safetensors"
    state = load_file(str(f))
    fn(state)
    save_file(state, str(f), metadata={"format": "pt"})


def test_missing_key_is_named(tmp_path):
    folder = _gpt2_folder(tmp_path)
    _edit_weights(folder, lambda s: s.pop("transformer.h.1.mlp.c_fc.bias"))
    with pytest.raises(CheckpointError, match=r"missing key 'h\.1\.mlp\.c_fc\.bias'"):
        qkv.from_pretrained(folder)


def test_unexpected_key_is_named(tmp_path):
    folder = _gpt2_folder(tmp_path)
    _edit_weights(folder, lambda s: s.update({"transformer.h.0.attn.q_norm.weight": torch.ones(16)}))
    with pytest.raises(CheckpointError, match=r"unexpected key 'h\.0\.attn\.q_norm\.weight'"):
        qkv.from_pretrained(folder)


def test_wrong_shape_is_named(tmp_path):
    folder = _gpt2_folder(tmp_path)
    _edit_weights(folder, lambda s: s.update({"transformer.h.0.attn.c_proj.weight": torch.zeros(16, 17)}))
    with pytest.raises(CheckpointError, match=r"h\.0\.attn\.c_proj\.weight has shape \(17, 16\)"):
        qkv.from_pretrained(folder)


def test_bert_wrong_shape_in_a_fused_qkv_names_its_sources(tmp_path):
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16)
    transformers.BertModel(cfg).save_pretrained(tmp_path)
    _edit_weights(tmp_path, lambda s: s.update({"encoder.layer.0.attention.self.key.bias": torch.zeros(15)}))
    with pytest.raises(CheckpointError, match=r"attention\.self\.key\.bias"):
        qkv.from_pretrained(tmp_path)


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba_xl", "hidden_size": 8}))
    with pytest.raises(CheckpointError, match=r"model_type 'mamba_xl' is not supported; supported: \["):
        qkv.from_pretrained(tmp_path)


def test_folder_without_weights(tmp_path):
    transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="has no weights"):
        qkv.from_pretrained(tmp_path)


def test_pickle_with_code_is_refused(tmp_path):
    """pytorch_model.bin is read with weights_only=True: a pickle that would call a function is refused."""
    transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2).save_pretrained(tmp_path)

    class Evil:
        def __reduce__(self):
            return (print, ("this must never run",))

    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"wte.weight": Evil()}, f, protocol=2)
    with pytest.raises(CheckpointError, match="cannot be read as a plain tensor state dict"):
        qkv.from_pretrained(tmp_path)


def test_unsupported_gpt2_option(tmp_path):
    cfg = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, scale_attn_by_inverse_layer_idx=True)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="scale_attn_by_inverse_layer_idx"):
        qkv.from_pretrained(tmp_path)


def test_expand_and_concatenate_and_transform():
    mapping = expand({"l.{}.q": "b.{}.qkv", "l.{}.k": "b.{}.qkv", "l.{}.v": "b.{}.qkv", "w": "emb"}, 2)
    assert mapping["l.1.k"] == "b.1.qkv" and len(mapping) == 7
    hf = {f"l.{i}.{n}": torch.full((2, 3), float(10 * i + j)) for i in range(2) for j, n in enumerate("qkv")}
    hf["w"] = torch.arange(6.0).view(2, 3)
    state, sources = convert_state(hf, mapping, transforms={"w": lambda t: t.t()})
    assert state["b.1.qkv"][:, 0].tolist() == [10, 10, 11, 11, 12, 12]  # q rows, then k, then v
    assert torch.equal(state["emb"], hf["w"].t())
    assert sources["b.0.qkv"] == ["l.0.q", "l.0.k", "l.0.v"]
    back = export_state(state, mapping, transforms={"w": lambda t: t.t()})
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_ignored_templates_match_any_layer_only():
    mapping = {"a": "x"}
    state = {"a": torch.zeros(1), "h.3.attn.bias": torch.zeros(1)}
    convert_state(state, mapping, ignore=("h.{}.attn.bias",))
    with pytest.raises(CheckpointError, match="unexpected key 'h.x.attn.bias'"):
        convert_state({"a": torch.zeros(1), "h.x.attn.bias": torch.zeros(1)}, mapping, ignore=("h.{}.attn.bias",))


@pytest.mark.parametrize("escape", ["../outside.safetensors", "{abs}"])
def test_shard_names_must_stay_inside_the_folder(tmp_path, escape):
    # a HF index whose shard name leaves the model folder must not be read, even when the file exists
    folder = _gpt2_folder(tmp_path / "model")
    outside = tmp_path / "outside.safetensors"
    (folder / "model.safetensors").rename(outside)
    name = str(outside) if escape == "{abs}" else escape
    keys = list(load_file(str(outside)))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: name for k in keys}}))
    with pytest.raises(CheckpointError, match="outside the model folder"):
        qkv.from_pretrained(folder)


def test_shard_symlink_pointing_outside_is_refused(tmp_path):
    folder = _gpt2_folder(tmp_path / "model")
    outside = tmp_path / "outside.safetensors"
    (folder / "model.safetensors").rename(outside)
    (folder / "shard-1.safetensors").symlink_to(outside)
    keys = list(load_file(str(outside)))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "shard-1.safetensors" for k in keys}}))
    with pytest.raises(CheckpointError, match="outside the model folder"):
        qkv.from_pretrained(folder)
