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


@pytest.mark.parametrize("call", ["print", "os.system"])
def test_pickle_with_code_is_refused(tmp_path, call):
    """pytorch_model.bin is read with weights_only=True: a pickle that would call a function is refused (torch
    words the refusal of a blocked module such as os/posix differently: its advice to retry must not show)."""
    import os

    transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2).save_pretrained(tmp_path)
    fn = print if call == "print" else os.system

    class Evil:
        def __reduce__(self):
            return (fn, ("echo this must never run",))

    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"wte.weight": Evil()}, f, protocol=2)
    with pytest.raises(CheckpointError, match="refused: it holds pickled objects other than tensors") as e:
        qkv.from_pretrained(tmp_path)
    # one line naming what was found, without torch's advice to retry with weights_only=False (which runs it)
    name = "print" if call == "print" else os.system.__module__ + ".system"  # posix.system on Linux
    assert "\n" not in str(e.value) and f"it would call {name}" in str(e.value) and "weights_only" not in str(e.value)


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


def test_a_sharded_folder_in_the_hub_cache_layout_loads(tmp_path):
    # snapshot_download / huggingface-cli download keep every file of snapshots/<rev>/ as a symlink into
    # ../../blobs/<hash>: each shard "points outside" the folder, and transformers loads it; so must qkv
    src = tmp_path / "src"
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2,
                                                               n_head=2))
    hf.eval().save_pretrained(src, max_shard_size="20KB")
    assert (src / "model.safetensors.index.json").is_file()
    repo = tmp_path / "hub" / "models--tiny--gpt2"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        (repo / "blobs" / f"{i:040x}").write_bytes(f.read_bytes())
        (repo / "snapshots" / "abc123" / f.name).symlink_to(f"../../blobs/{i:040x}")
    model = qkv.from_pretrained(repo / "snapshots" / "abc123").eval()
    ids = torch.randint(0, 40, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)


def _tiny_llama(path):
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("make, field", [(_gpt2_folder, "n_embd"), (_tiny_llama, "hidden_size")])
def test_a_config_without_a_required_field_or_with_a_bad_value(tmp_path, make, field):
    folder = make(tmp_path)
    meta = json.loads((folder / "config.json").read_text())
    del meta[field]
    (folder / "config.json").write_text(json.dumps(meta))
    if make is _tiny_llama:  # GPT-2's fields have defaults, as in transformers
        with pytest.raises(CheckpointError, match=f"needs the field '{field}', which is missing"):
            qkv.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**meta, field: "forty"}))
    with pytest.raises(CheckpointError, match="config.json: a .* field has an unusable value"):
        qkv.from_pretrained(folder)


@pytest.mark.parametrize("make", [_gpt2_folder, _tiny_llama])
@pytest.mark.parametrize("weight_map", [[], {"wte.weight": None}, "x"])
def test_a_malformed_shard_index_is_one_clear_error(tmp_path, make, weight_map):
    """Both readers (the Llama family's tensor-at-a-time one and the generic one) share shard_files."""
    folder = make(tmp_path)
    (folder / "model.safetensors").rename(folder / "shard-1.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="weight_map must map tensor names to shard file names"):
        qkv.from_pretrained(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps([1, 2]))
    with pytest.raises(CheckpointError, match="not a valid shard index"):
        qkv.from_pretrained(folder)


def test_map_location_applies_to_a_hugging_face_folder(tmp_path):
    model = qkv.from_pretrained(_tiny_llama(tmp_path), map_location="meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}


@pytest.mark.parametrize("config, message", [
    ("null", "expected a JSON object, got NoneType"),
    ('["gpt2"]', "expected a JSON object, got list"),
    ('{"model_type": ["gpt2"]}', "model_type must be a string"),
])
def test_a_config_json_of_another_shape_is_one_error(tmp_path, config, message):
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(CheckpointError, match=message):
        qkv.from_pretrained(tmp_path)
