"""qkv checkpoint folders: exact round trips, re-tied weights, clear errors, no pickle, atomic saves and
no wrapper prefixes in the keys."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from torch import nn

import qkv
from qkv.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    clean_state_dict,
    load_model,
    load_state_into,
    save_model,
    unwrap,
)

TINY = {
    "gpt": {"family": "gpt", "vocab_size": 19, "n_layers": 2, "d_model": 16, "n_heads": 2,
            "context_length": 8},
    "bert": {"family": "bert", "vocab_size": 19, "n_layers": 2, "d_model": 16, "n_heads": 2,
             "context_length": 8, "head": "mlm", "norm": "batchnorm"},
    "encdec": {"family": "encdec", "src_vocab_size": 19, "n_encoder_layers": 1, "n_decoder_layers": 1,
               "d_model": 16, "n_heads": 2, "d_ff": 32, "context_length": 8, "position": "rope"},
}


def logits(model, ids):
    kw = {"decoder_input_ids": ids} if isinstance(model, qkv.EncoderDecoder) else {}
    return model.eval()(ids, **kw).logits


@pytest.mark.parametrize("family", list(TINY))
def test_round_trip_gives_identical_logits(tmp_path, family):
    model = qkv.build(TINY[family])
    if family == "bert":  # BatchNorm running statistics are state too: move them off their init
        model.train()(torch.randint(0, 19, (4, 8)))
    ids = torch.randint(0, 19, (2, 6))
    before = logits(model, ids)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = qkv.from_pretrained(tmp_path / "ckpt")
    assert type(loaded) is type(model) and loaded.config == model.config
    assert torch.equal(logits(loaded, ids), before)
    assert torch.equal(logits(qkv.from_pretrained(tmp_path / "ckpt" / CONFIG_NAME), ids), before)
    sd, lsd = model.state_dict(), loaded.state_dict()
    assert sd.keys() == lsd.keys() and all(torch.equal(sd[k], lsd[k]) for k in sd)


def test_tied_weights_are_stored_once_and_re_tied(tmp_path):
    model = qkv.build(TINY["gpt"])
    save_model(model, tmp_path)
    with safe_open(str(tmp_path / WEIGHTS_NAME), "pt") as f:
        keys = set(f.keys())
    assert "tok_emb.weight" in keys and "lm_head.weight" not in keys
    loaded = load_model(tmp_path)
    assert loaded.lm_head.weight is loaded.tok_emb.weight
    # training the loaded model keeps the tie: one parameter, one update
    assert loaded.num_parameters() == model.num_parameters()
    enc = load_model(save_model(qkv.build(TINY["encdec"]), tmp_path / "ed"))
    assert enc.lm_head.weight is enc.src_emb.weight is enc.tgt_emb.weight


def test_safetensors_file_has_no_pickle(tmp_path):
    save_model(qkv.build(TINY["gpt"]), tmp_path)
    raw = (tmp_path / WEIGHTS_NAME).read_bytes()
    # safetensors = 8-byte little-endian header length, a JSON header, raw tensor bytes
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    assert "tok_emb.weight" in header and header["__metadata__"]["qkv_family"] == "gpt"
    assert not raw.startswith(b"\x80") and b"PK\x03\x04" not in raw[:8]  # neither a pickle nor a zip
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert config["qkv_family"] == "gpt" and config["config"]["d_model"] == 16
    assert sorted(os.listdir(tmp_path)) == [CONFIG_NAME, WEIGHTS_NAME]  # no temporary files left


def test_wrong_architecture_and_shapes_are_checkpoint_errors(tmp_path):
    gpt = qkv.build(TINY["gpt"])
    save_model(gpt, tmp_path / "gpt")
    state = clean_state_dict(gpt.state_dict())
    bert = qkv.build(TINY["bert"])
    with pytest.raises(CheckpointError, match="does not fit this BERT: missing"):
        load_state_into(bert, state)
    # a GPT folder whose config.json claims to be a BERT
    meta = {"qkv_family": "bert", "config": {k: v for k, v in TINY["bert"].items() if k != "family"}}
    (tmp_path / "gpt" / CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="does not fit"):
        load_model(tmp_path / "gpt")
    wider = qkv.build({**TINY["gpt"], "vocab_size": 23})
    with pytest.raises(CheckpointError,
                       match=r"tok_emb.weight has shape \(19, 16\), model expects \(23, 16\)"):
        load_state_into(wider, state)
    with pytest.raises(CheckpointError, match="unexpected"):
        load_state_into(gpt, {**state, "extra.weight": torch.zeros(1)})


def test_missing_or_broken_folders_are_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        qkv.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="has no config.json"):
        qkv.from_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        qkv.from_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"hello": 1}))
    with pytest.raises(CheckpointError, match="neither a qkv family"):
        qkv.from_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"qkv_family": "gpt", "config": {"n_head": 2}}))
    with pytest.raises(CheckpointError, match="did you mean 'n_heads'"):
        qkv.from_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"qkv_family": "lstm9", "config": {}}))
    with pytest.raises(CheckpointError, match="unknown model family"):
        qkv.from_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"qkv_family": "gpt"}))
    with pytest.raises(CheckpointError, match="config"):
        qkv.from_pretrained(tmp_path)
    save_model(qkv.build(TINY["gpt"]), tmp_path / "nw")
    (tmp_path / "nw" / WEIGHTS_NAME).unlink()
    with pytest.raises(CheckpointError, match="has no model.safetensors"):
        qkv.from_pretrained(tmp_path / "nw")
    save_model(qkv.build(TINY["gpt"]), tmp_path / "trunc")
    w = tmp_path / "trunc" / WEIGHTS_NAME
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(CheckpointError):
        qkv.from_pretrained(tmp_path / "trunc")


def test_interrupted_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    # the weights are renamed into place first, so a crash there leaves the old folder byte for byte
    old = qkv.build(TINY["gpt"])
    save_model(old, tmp_path)
    ids = torch.randint(0, 19, (1, 5))
    expected = logits(old, ids)
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}

    new = qkv.build(TINY["gpt"])
    real_replace = os.replace
    calls = []

    def crash(src, dst):  # the temporary file is fully written; the process dies before the rename
        calls.append(dst)
        assert os.path.getsize(src) > 0
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        save_model(new, tmp_path)
    monkeypatch.setattr(os, "replace", real_replace)
    assert calls
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before  # same files, same bytes, no leftovers
    torch.testing.assert_close(logits(load_model(tmp_path), ids), expected, atol=0, rtol=0)


class _CompiledStandIn(nn.Module):
    """What torch.compile returns: a module holding the real one as `_orig_mod`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._orig_mod = model


class _DDPStandIn(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = model


def test_wrapper_prefixes_never_reach_the_keys(tmp_path):
    model = qkv.build(TINY["gpt"])
    wrapped = _CompiledStandIn(model)
    assert next(iter(wrapped.state_dict())).startswith("_orig_mod.")
    assert unwrap(wrapped) is model
    save_model(wrapped, tmp_path / "c")
    with safe_open(str(tmp_path / "c" / WEIGHTS_NAME), "pt") as f:
        keys = list(f.keys())
    assert keys and not any("_orig_mod" in k or k.startswith("module.") for k in keys)
    assert torch.equal(logits(load_model(tmp_path / "c"), torch.tensor([[1, 2]])),
                       logits(model, torch.tensor([[1, 2]])))

    # a DDP-style `module.` prefix in a state dict (e.g. saved by other code) is stripped too
    sd = _DDPStandIn(_CompiledStandIn(model)).state_dict()
    assert all(k.startswith("module._orig_mod.") for k in sd)
    cleaned = clean_state_dict(sd)
    assert set(cleaned) == set(clean_state_dict(model.state_dict()))
    load_state_into(qkv.build(TINY["gpt"]), cleaned)


def test_torch_compile_wrapper_is_unwrapped(tmp_path):
    model = qkv.build(TINY["gpt"])
    compiled = torch.compile(model)  # wrapping is lazy: nothing is compiled until it is called
    save_model(compiled, tmp_path)
    with safe_open(str(tmp_path / WEIGHTS_NAME), "pt") as f:
        assert not any("_orig_mod" in k for k in f.keys())
    load_model(tmp_path)


def _save_killed_before_the_config(model, folder, monkeypatch):
    """save_model(model, folder) killed between its two renames: the weights replaced, the config not."""
    real_replace = os.replace

    def crash_on_config(src, dst):
        if str(dst).endswith(CONFIG_NAME):
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_config)
    with pytest.raises(KeyboardInterrupt):
        save_model(model, folder)
    monkeypatch.setattr(os, "replace", real_replace)


def test_crash_before_the_config_rename_leaves_a_loadable_folder(tmp_path, monkeypatch):
    # weights first, config last: a crash between the two renames leaves the new weights beside the old
    # (same-architecture) config: the folder still loads, to the new model, and has no temporary files
    save_model(qkv.build(TINY["gpt"]), tmp_path)
    new = qkv.build(TINY["gpt"])
    _save_killed_before_the_config(new, tmp_path, monkeypatch)
    assert sorted(os.listdir(tmp_path)) == [CONFIG_NAME, WEIGHTS_NAME]
    ids = torch.randint(0, 19, (1, 5))
    assert torch.equal(logits(load_model(tmp_path), ids), logits(new, ids))


def test_crash_between_the_renames_over_another_function_is_refused_at_load(tmp_path, monkeypatch):
    # the same shapes, another function (ffn, scaled): the new weights beside the old config would load
    # silently into the old architecture; the weights carry their config (metadata), so the pair is refused
    save_model(qkv.build(TINY["gpt"]), tmp_path)
    new = qkv.build({**TINY["gpt"], "ffn": "relu", "scaled": False})
    _save_killed_before_the_config(new, tmp_path, monkeypatch)
    with pytest.raises(CheckpointError,
                       match=r"saved for another model than the config.json beside it describes: "
                             r"ffn relu \(weights\) vs gelu \(config.json\), scaled False"):
        load_model(tmp_path)
    meta = json.loads((tmp_path / CONFIG_NAME).read_text())
    meta["config"].update(ffn="relu", scaled=False, dropout=0.3)  # an edited config.json: dropout may differ
    (tmp_path / CONFIG_NAME).write_text(json.dumps(meta))
    assert load_model(tmp_path).config.dropout == 0.3
    save_model(new, tmp_path)  # saving again mends it
    ids = torch.randint(0, 19, (1, 5))
    assert torch.equal(logits(load_model(tmp_path), ids), logits(new, ids))


def test_saved_files_and_folders_follow_the_umask(tmp_path):
    # tempfile creates owner-only files (0600) and folders (0700), which the renames kept: a model another
    # account serves, or a team folder, could not read them. Now what open() / mkdir() give under the umask.
    # (training checkpoints: tests/train/test_trainer.py)
    old = os.umask(0o022)
    try:
        save_model(qkv.build(TINY["gpt"]), tmp_path / "m")
        modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "m").iterdir()}
        assert modes == {CONFIG_NAME: 0o644, WEIGHTS_NAME: 0o644}
        os.umask(0o077)
        save_model(qkv.build(TINY["gpt"]), tmp_path / "private")
        assert {p.stat().st_mode & 0o777 for p in (tmp_path / "private").iterdir()} == {0o600}
    finally:
        os.umask(old)


def test_the_umask_is_read_without_being_changed(monkeypatch):
    # Reading the umask by setting it to 0 and back would give a file another thread creates in that instant
    # world-writable modes; on Linux it is read from /proc/self/status instead.
    from qkv.storage import process_umask

    old = os.umask(0o027)
    try:
        calls = []
        monkeypatch.setattr(os, "umask", lambda m: calls.append(m) or 0o027)
        if os.path.exists("/proc/self/status"):
            assert process_umask() == 0o027 and calls == []
        monkeypatch.undo()
        for mask in (0o022, 0o077, 0o002):
            os.umask(mask)
            assert process_umask() == mask
    finally:
        os.umask(old)


def test_a_file_that_is_not_a_json_config_is_a_checkpoint_error(tmp_path):
    save_model(qkv.build(TINY["gpt"]), tmp_path)
    with pytest.raises(CheckpointError, match="not valid JSON.*pass the model folder"):
        qkv.from_pretrained(tmp_path / WEIGHTS_NAME)
    (tmp_path / CONFIG_NAME).write_bytes(b'{"qkv_family": "gpt\xc0"}')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        qkv.from_pretrained(tmp_path)


@pytest.mark.parametrize("name,old,new", [("vit-digits", "pos_emb", "encoder.position.weight"),
                                          ("whisper-digits", "audio_pos", "encoder.position.weight")])
def test_folders_written_before_a_position_table_moved_still_load(name, old, new, tmp_path):
    """ViT's and Whisper's position tables moved behind the stack's position hook (nn/position.py); a
    folder saved with the old key loads through the family's renamed_keys."""
    from safetensors.torch import load_file, save_file

    model = qkv.build(name).eval()
    with torch.no_grad():
        model.state_dict()[new].add_(torch.randn_like(model.state_dict()[new]))  # not the init values
    save_model(model, tmp_path)
    state = load_file(str(tmp_path / WEIGHTS_NAME))
    state[old] = state.pop(new)
    save_file(state, str(tmp_path / WEIGHTS_NAME), metadata={"qkv_family": model.family})
    again = load_model(tmp_path)
    assert torch.equal(again.state_dict()[new], model.state_dict()[new])
