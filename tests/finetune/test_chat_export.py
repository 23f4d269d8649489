"""Which weights the chat recipe exports: the best dev loss's checkpoint by default (as transformers'
load_best_model_at_end), the last step's with --export last, and the report says which; and a run too short to
learn (the default single epoch of a small set) is warned about."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from test_chat_recipe import _finetune, chats, write_jsonl

from qkv import from_pretrained
from qkv.finetune.chat import FEW_STEPS, ChatSettings, _train_config
from qkv.train import Trainer, latest_checkpoint
from qkv.train.checkpoint import read_checkpoint
from qkv.train.config import train_overrides


def _weights_of(checkpoint, source, lora: bool) -> dict[str, torch.Tensor]:
    """The model state a training checkpoint holds, adapters merged as the recipe merges them on save."""
    from qkv.finetune.lora import LoRAConfig, apply_lora, merge_lora

    model = from_pretrained(source)
    if lora:
        apply_lora(model, LoRAConfig(rank=8, alpha=16.0, dropout=0.05, targets=["q", "v"]))
    model.load_state_dict(read_checkpoint(checkpoint)[0], strict=False)
    if lora:
        merge_lora(model)
    return model.state_dict()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("lora", [False, True])
def test_out_holds_the_best_dev_loss_weights(gpt2_chat, tmp_path, capsys, monkeypatch, lora):
    """The first evaluation (step 2) stays the best: OUT holds step 2's weights, not step 4's (it held the
    last step's while the log said "best eval loss at step 2")."""
    monkeypatch.setattr(Trainer, "_is_better", lambda self, value, than: than is None)
    data = write_jsonl(tmp_path / "train.jsonl", chats())
    dev = write_jsonl(tmp_path / "dev.jsonl", chats(with_system=False)[:2])
    out = tmp_path / "out"
    extra = ["--lora", "train.lr=1e-2"] if lora else ["train.lr=1e-3"]
    assert _finetune(gpt2_chat, data, out, "--dev", str(dev), "train.max_steps=4", "train.eval_every=2",
                     "train.batch_size=2", *extra) == 0
    report = capsys.readouterr().out
    exported = from_pretrained(out).state_dict()
    best = _weights_of(out / "checkpoints" / "best", gpt2_chat, lora)
    last = _weights_of(latest_checkpoint(out / "checkpoints"), gpt2_chat, lora)
    assert _same(exported, best) and not _same(exported, last)
    assert (f"model folder: {out} (Hugging Face gpt2 format{', LoRA merged' if lora else ''}): the weights "
            "of step 2, the best dev loss (" in report and "the last step, 4, is in " in report)
    assert json.loads((out / "finetune.json").read_text())["exported_step"] == 2


def test_export_last_keeps_the_last_step_and_says_where_the_best_is(gpt2_chat, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Trainer, "_is_better", lambda self, value, than: than is None)
    data = write_jsonl(tmp_path / "train.jsonl", chats())
    dev = write_jsonl(tmp_path / "dev.jsonl", chats(with_system=False)[:2])
    out = tmp_path / "out"
    assert _finetune(gpt2_chat, data, out, "--dev", str(dev), "train.max_steps=4", "train.eval_every=2",
                     "train.batch_size=2", "train.lr=1e-3", "--export", "last") == 0
    report = capsys.readouterr().out
    assert _same(from_pretrained(out).state_dict(),
                 _weights_of(latest_checkpoint(out / "checkpoints"), gpt2_chat, False))
    assert f"model folder: {out} (Hugging Face gpt2 format): the weights of the last step, 4" in report
    assert f"was at step 2, not in the model folder (--export last): its training checkpoint is " \
           f"{out / 'checkpoints' / 'best'}" in report
    assert json.loads((out / "finetune.json").read_text())["exported_step"] == 4


def test_export_is_a_chat_flag(gpt2_chat, tmp_path, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", chats())
    with pytest.raises(SystemExit) as e:
        _finetune(gpt2_chat, data, tmp_path / "o", "--export", "first")
    assert e.value.code == 2
    assert "invalid choice: 'first'" in capsys.readouterr().err


def _args(tmp_path, overrides: list[str], epochs: float | None) -> ChatSettings:
    more = {} if epochs is None else {"epochs": epochs}
    return ChatSettings(model="m", data="d", out=tmp_path, progress=False, train=train_overrides(overrides),
                        **more)


def test_a_handful_of_steps_is_warned_about(tmp_path):
    """50 conversations at batch 8 are 7 updates an epoch: LoRA at its defaults barely moved the loss,
    silently. Steps set by --epochs below FEW_STEPS are a warning that says how many epochs would do; steps
    the user set with train.max_steps are not."""
    with pytest.warns(UserWarning,
                      match=r"1 epoch\(s\) of 50 conversation\(s\) at batch 8 is 7 optimizer step\(s\), "
                            r"too few to learn much: pass --epochs 8 \(~56 steps\).*all-linear"):
        assert _train_config(_args(tmp_path, [], None), n_train=50, n_dev=0, lora=True).max_steps == 7
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _train_config(_args(tmp_path, ["train.max_steps=7"], None), 50, 0, lora=True).max_steps == 7
        assert _train_config(_args(tmp_path, [], 8.0), 50, 0, lora=False).max_steps == 56 >= FEW_STEPS
        assert _train_config(_args(tmp_path, [], None), 8 * FEW_STEPS, 0, lora=True).max_steps == FEW_STEPS
