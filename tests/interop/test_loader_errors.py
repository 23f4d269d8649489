"""The HF loaders fail with one clear CheckpointError naming the culprit: a missing key, an unexpected key,
a wrong shape, an unknown model_type, absent weights, a pickle that is not a plain state dict. Also the
generic pieces of qkv.interop.common (map expansion, q/k/v concatenation, transforms) on small inputs."""

from __future__ import annotations

import json
import pickle
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

import _seq2seq_models  # noqa: E402

import qkv  # noqa: E402
from qkv.checkpoint import CheckpointError  # noqa: E402
from qkv.interop.common import expand, export_state, load_hf_weights  # noqa: E402


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
    assert ("\n" not in str(e.value) and f"it would call {name}" in str(e.value)
            and "weights_only" not in str(e.value))


def test_unsupported_gpt2_option(tmp_path):
    cfg = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, scale_attn_by_inverse_layer_idx=True)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="scale_attn_by_inverse_layer_idx"):
        qkv.from_pretrained(tmp_path)


def _module_with(shapes: dict[str, tuple[int, ...]]) -> torch.nn.Module:
    """A module whose parameters are `shapes` (dotted names: nested submodules)."""
    root = torch.nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape)))
    return root


def test_expand_and_concatenate_and_transform():
    mapping = expand({"l.{}.q": "b.{}.qkv", "l.{}.k": "b.{}.qkv", "l.{}.v": "b.{}.qkv", "w": "emb"}, 2)
    assert mapping["l.1.k"] == "b.1.qkv" and len(mapping) == 7
    hf = {f"l.{i}.{n}": torch.full((2, 3), float(10 * i + j)) for i in range(2) for j, n in enumerate("qkv")}
    hf["w"] = torch.arange(6.0).view(2, 3)
    model = _module_with({"b.0.qkv": (6, 3), "b.1.qkv": (6, 3), "emb": (3, 2)})
    state = load_hf_weights(model, hf, mapping, transforms={"w": lambda t: t.t()}).state_dict()
    assert state["b.1.qkv"][:, 0].tolist() == [10, 10, 11, 11, 12, 12]  # q rows, then k, then v
    assert torch.equal(state["emb"], hf["w"].t())
    back = export_state(state, mapping, transforms={"w": lambda t: t.t()})
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_ignored_templates_match_any_layer_only():
    mapping = {"a": "x"}
    state = {"a": torch.zeros(1), "h.3.attn.bias": torch.zeros(1)}
    load_hf_weights(_module_with({"x": (1,)}), state, mapping, ignore=("h.{}.attn.bias",))
    with pytest.raises(CheckpointError, match="unexpected key 'h.x.attn.bias'"):
        load_hf_weights(_module_with({"x": (1,)}), {"a": torch.zeros(1), "h.x.attn.bias": torch.zeros(1)},
                        mapping, ignore=("h.{}.attn.bias",))


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
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=40, n_positions=16,
                                                              n_embd=16, n_layer=2,
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


# -- config.json sizes against the weights, before anything is allocated ------------------------------------
def _bert_folder(path, cls="BertConfig", model="BertModel", **kw):
    cfg = getattr(transformers, cls)(vocab_size=40, max_position_embeddings=20, **kw)
    getattr(transformers, model)(cfg).save_pretrained(path)
    return path


def _bert(path):
    return _bert_folder(path, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=24)


def _distilbert(path):
    return _bert_folder(path, "DistilBertConfig", "DistilBertModel", dim=16, n_layers=2,
                        n_heads=2, hidden_dim=24)


def _vit(path):
    cfg = transformers.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=16,
                                 num_hidden_layers=1, num_attention_heads=2, intermediate_size=24)
    transformers.ViTModel(cfg).save_pretrained(path)
    return path


def _whisper(path):
    cfg = transformers.WhisperConfig(vocab_size=40, num_mel_bins=8, d_model=16, encoder_layers=1,
                                     decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
                                     decoder_ffn_dim=24, max_source_positions=10, max_target_positions=12,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=1, decoder_start_token_id=1)
    transformers.WhisperForConditionalGeneration(cfg).save_pretrained(path)
    return path


def _t5(path):
    _seq2seq_models.t5(path)
    return path


def _bart(path):
    _seq2seq_models.bart(path)
    return path


HUGE = [(_gpt2_folder, "n_layer", 10**9), (_gpt2_folder, "n_embd", 10**9),
        (_gpt2_folder, "vocab_size", 10**12),
        (_gpt2_folder, "n_positions", 10**10), (_gpt2_folder, "n_inner", 10**9),
        (_tiny_llama, "num_hidden_layers", 10**9), (_tiny_llama, "vocab_size", 10**12),
        (_tiny_llama, "hidden_size", 10**9), (_tiny_llama, "intermediate_size", 10**9),
        (_bert, "num_hidden_layers", 10**9), (_bert, "max_position_embeddings", 10**10),
        (_bert, "intermediate_size", 10**9), (_distilbert, "dim", 10**9), (_distilbert, "n_layers", 10**9),
        (_vit, "num_hidden_layers", 10**9), (_vit, "image_size", 8 * 10**5),
        (_vit, "intermediate_size", 10**9),
        (_whisper, "decoder_layers", 10**9), (_whisper, "max_source_positions", 10**10),
        (_whisper, "vocab_size", 10**12), (_t5, "num_layers", 10**9), (_t5, "vocab_size", 10**12),
        (_t5, "d_ff", 10**9), (_bart, "decoder_layers", 10**9), (_bart, "d_model", 10**9),
        (_bart, "max_position_embeddings", 10**10)]


@pytest.mark.parametrize("make, field, value", HUGE, ids=[f"{m.__name__}-{f}" for m, f, _ in HUGE])
def test_a_config_size_the_weights_do_not_have_is_named_before_anything_is_built(tmp_path,
                                                                                 make, field, value):
    """config.json's sizes are checked against the shapes in the file's header first: a huge field is named at
    once (it expanded the key map per layer, or allocated the model, until memory ran out)."""
    folder = make(tmp_path / "m")
    meta = json.loads((folder / "config.json").read_text())
    meta[field] = value
    (folder / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=rf"config\.json: {re.escape(field)}.* is {value}|{field}.*but"):
        qkv.from_pretrained(folder)


def test_a_huge_size_is_one_cli_error(tmp_path, capsys):
    from qkv.cli.main import main

    folder = _gpt2_folder(tmp_path / "m")
    meta = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**meta, "n_embd": 10**9}))
    capsys.readouterr()
    for argv in (["info", str(folder)], ["generate", str(folder), "--prompt", "hi", "--max-new-tokens", "2"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines() == [f"qkv: error: {folder}/config.json: n_embd is 1000000000, but "
                                            f"{folder}/model.safetensors has wte.weight of shape (50, 16) "
                                            "(n_embd would be 16)"]


def test_a_deeply_nested_config_is_one_error(tmp_path):
    (tmp_path / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        qkv.from_pretrained(tmp_path)
