"""The chat recipe's named phases: settings read from the command line in one place, setup_data giving the
batches the data functions give on their own, and report() returning exactly the lines `qkv finetune`
prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qkv.cli.main import main
from qkv.config import ConfigError
from qkv.finetune.chat import ChatRecipe, ChatSettings
from qkv.finetune.chat_data import ChatData, build_examples, read_chats
from qkv.interop.tokenizer import load_hf_tokenizer

ROWS = [{"prompt": f"What is {i} plus one?", "completion": f"{i + 1}."} for i in range(6)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _args(model: Path, data: Path, out: Path, **extra) -> ChatSettings:
    return ChatSettings(model=str(model), data=str(data), out=str(out), progress=False, **extra)


def test_settings_are_complete_and_checked_in_one_place(gpt2_chat, tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", ROWS)
    s = _args(gpt2_chat, data, tmp_path / "out", lora=True, lora_rank=4, too_long="skip", max_length=64,
              train={"seed": 3})
    lora = s.lora_config()
    assert (s.out, lora.rank, lora.alpha, lora.targets, s.too_long, s.max_length) == (
        tmp_path / "out", 4, 16.0, ["q", "v"], "skip", 64)
    assert (s.seed, s.epochs) == (3, 1.0)  # train.seed is the recipe's seed too; one epoch is chat's default
    assert _args(gpt2_chat, data, tmp_path / "o").lora_config() is None
    with pytest.raises(ConfigError, match="--lora-rank needs --lora"):
        _args(gpt2_chat, data, tmp_path / "o", lora_rank=8)
    with pytest.raises(ConfigError, match="--too-long truncate is not supported by --task chat"):
        _args(gpt2_chat, data, tmp_path / "o", too_long="truncate")
    with pytest.raises(ConfigError, match="--lora-rank must be at least 1"):
        _args(gpt2_chat, data, tmp_path / "o", lora=True, lora_rank=0)


def test_setup_data_gives_the_batches_of_the_data_functions(gpt2_chat, tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", ROWS)
    recipe = ChatRecipe(_args(gpt2_chat, data, tmp_path / "out", max_length=48))
    model = recipe.setup_model()
    assert recipe.notes == [] and not any(p.dtype != torch.float32 for p in model.parameters())
    got = recipe.setup_data()
    tok = load_hf_tokenizer(gpt2_chat)
    examples, skipped = build_examples(tok, read_chats(data), 48, str(data), "error")
    want = ChatData(examples, [], tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                    seed=0)
    assert skipped == [] and recipe.max_length == 48 and recipe.cfg.seed == 0
    for i in range(want.batches_per_epoch(4) + 1):  # one epoch and the first batch of the next
        a, b = got.batch(i, 4), want.batch(i, 4)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert not (tmp_path / "out").exists()  # setting up writes nothing


def test_report_is_what_the_command_prints(gpt2_plain, tmp_path, capsys, monkeypatch):
    data = _jsonl(tmp_path / "d.jsonl", ROWS)
    reports: list[list[str]] = []
    real = ChatRecipe.report
    monkeypatch.setattr(ChatRecipe, "report", lambda self: reports.append(real(self)) or reports[-1])
    assert main(["finetune", str(gpt2_plain), "--data", str(data), "--out", str(tmp_path / "out"),
                 "--no-progress", "train.max_steps=2", "train.batch_size=2", "train.plot=false",
                 "train.tensorboard=false"]) == 0
    out, err = capsys.readouterr()
    # the training log's step lines come first; the command's own output is the report, line for line
    assert len(reports) == 1 and out.endswith("\n" + "\n".join(reports[0]) + "\n")
    assert "fine-tuned" not in out.split("\n" + reports[0][0])[0]
    lines = reports[0]
    assert lines[0].startswith(f"fine-tuned {gpt2_plain} on 6 conversations ({data}), 2 steps; full "
                               "fine-tuning")
    assert any(line.startswith("note: ") and "no chat template" in line for line in lines)
    assert f"qkv: note: {gpt2_plain} has no chat template" in err  # said before training starts, too
    saved = json.loads((tmp_path / "out" / "finetune.json").read_text(encoding="utf-8"))
    assert saved["recipe"] == "chat" and saved["steps"] == 2 and saved["chat_template"] is False
