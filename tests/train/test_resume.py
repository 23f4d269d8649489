"""train/resume.py on its own: where fit() starts (fresh, resumed, repaired), what a resume finds in the log,
which changed settings it notes, and checkpoints/best's record."""

from __future__ import annotations

import json

import pytest

from qkv.config import ConfigError
from qkv.train import StopAt, TrainConfig, Trainer
from qkv.train import resume as resume_


def test_start_is_fresh_resumed_or_refused(tmp_path, make_gpt, toy_data, cfg_factory):
    tr = Trainer(make_gpt(), cfg_factory(max_steps=4, save_every=2), toy_data, callbacks=[StopAt(2)])
    begin = tr.begin()
    assert (begin.resumed_from, begin.repaired, begin.fresh_note) == (None, [], "")
    tr.fit()
    stale = tr.ckpt_root / ".step_00000009.123.tmp"
    stale.mkdir()
    again = Trainer(make_gpt(), cfg_factory(max_steps=4, save_every=2, resume=True), toy_data)
    begin = again.begin()
    assert begin.resumed_from == tr.ckpt_root / "step_00000002" and again.step == 2
    assert begin.repaired == [f"removed {stale.name}"] and not stale.exists()
    with pytest.raises(ConfigError, match="already holds checkpoints of another run"):
        Trainer(make_gpt(), cfg_factory(max_steps=4), toy_data).begin()


def test_a_resume_without_checkpoints_starts_fresh_with_a_note(tmp_path, make_gpt, toy_data, cfg_factory):
    tr = Trainer(make_gpt(), cfg_factory(max_steps=2, resume=True), toy_data)
    with pytest.warns(UserWarning, match="holds no checkpoint: starting fresh"):
        begin = tr.begin()
    assert begin.resumed_from is None and "starting fresh" in begin.fresh_note


def test_logged_at_resume_reads_the_last_steps_records():
    records = [{"step": 3, "loss": 2.0}, {"step": 4, "loss": 1.5},
               {"step": 4, "eval/loss": "nan", "eval/acc": 0.5}]
    evaluation, loss = resume_.logged_at_resume(records, 4)
    assert loss == 1.5 and evaluation["_step"] == 4 and evaluation["acc"] == 0.5
    assert evaluation["loss"] != evaluation["loss"]  # "nan" in metrics.jsonl is read back as a float nan
    assert resume_.logged_at_resume(records, 5) == ({}, None)


def test_changed_settings_name_what_makes_a_resume_inexact():
    cfg = TrainConfig(lr=1e-3, batch_size=8, grad_accum=2, betas=(0.9, 0.95))
    saved = {"lr": 1e-3, "batch_size": 4, "grad_accum": 2, "betas": [0.9, 0.95], "log_every": 5}
    assert resume_.changed_settings(saved, 1, cfg, 1) == {"batch_size": (4, 8)}
    changed = resume_.changed_settings({**saved, "batch_size": 8}, 2, cfg, 1)
    assert changed == {"micro-batches per update": (4, 2)}


def test_best_on_disk_is_the_record_of_checkpoints_best(tmp_path):
    best = tmp_path / "best"
    best.mkdir()
    assert resume_.best_on_disk(tmp_path, "loss") is None
    (best / "eval.json").write_text(json.dumps({"loss": 0.25, "step": 6}), encoding="utf-8")
    assert resume_.best_on_disk(tmp_path, "loss") == {"metric": "loss", "value": 0.25, "step": 6}
    assert resume_.best_on_disk(tmp_path, "acc") is None
    (best / "eval.json").write_text(json.dumps({"loss": "nan", "step": 6}), encoding="utf-8")
    assert resume_.best_on_disk(tmp_path, "loss") is None
