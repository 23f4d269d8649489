"""Trainer settings that would do nothing useful: an evaluation interval with nothing to evaluate, a warmup as
long as the run."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_eval_every_with_nothing_to_evaluate_warns_and_logs_no_eval(tmp_path, make_gpt, toy_data,
                                                                    cfg_factory):
    """No evaluation function and max_eval_batches=0: eval_every used to log a fake eval loss of 0.0 and keep
    a 'best' checkpoint by it; now it says so once and evaluates nothing."""
    from qkv.train import Trainer

    cfg = cfg_factory(max_steps=4, eval_every=2, max_eval_batches=0)
    with pytest.warns(UserWarning, match="train.eval_every=2 has nothing to evaluate"):
        trainer = Trainer(make_gpt(), cfg, toy_data)
    summary = trainer.fit()
    assert summary["best_eval"] is None and summary["best_checkpoint"] is None
    assert not any(k.startswith("eval/") for r in trainer.logger.records for k in r)


def test_a_warmup_as_long_as_the_run_is_flagged(make_gpt, toy_data, cfg_factory):
    """Not an error (a 2-step smoke run of a shipped config has warmup 100), but said: the cosine never
    starts."""
    from qkv.train import Trainer

    with pytest.warns(UserWarning,
                      match="warmup of 8 steps >= max_steps=4: the cosine schedule never reaches"):
        Trainer(make_gpt(), cfg_factory(max_steps=4, warmup=8, schedule="cosine"), toy_data)


def test_a_fresh_run_in_a_folder_with_checkpoints_is_refused_and_deletes_nothing(make_gpt, toy_data,
                                                                                 cfg_factory):
    """Its pruning kept the older run's higher steps and deleted the checkpoint it had just written (its
    summary named a folder that no longer existed); the CLI refused this already, now the Trainer does."""
    from qkv.config import ConfigError
    from qkv.train import Trainer, list_checkpoints

    first = Trainer(make_gpt(), cfg_factory(max_steps=6, save_every=2, keep_last=2), toy_data).fit()
    root = Path(first["checkpoint"]).parent
    before = [n for n, _ in list_checkpoints(root)]
    with pytest.raises(ConfigError,
                       match="already holds checkpoints of another run .up to step 6.: resume=True"):
        Trainer(make_gpt(seed=1), cfg_factory(max_steps=2, save_every=2, keep_last=2), toy_data).fit()
    assert [n for n, _ in list_checkpoints(root)] == before == [4, 6]
    resumed = Trainer(make_gpt(), cfg_factory(max_steps=8, save_every=2, keep_last=2), toy_data,
                      resume=True).fit()
    assert Path(resumed["checkpoint"]).is_dir() and resumed["steps"] == 8


def test_resume_into_another_architecture_of_the_same_shapes_is_refused(make_gpt, toy_data, cfg_factory):
    """The CLI's check (ffn / scaled differ, shapes fit) now lives where the Trainer loads a checkpoint."""
    from qkv.checkpoint import CheckpointError
    from qkv.train import Trainer

    Trainer(make_gpt(), cfg_factory(max_steps=2, save_every=2), toy_data).fit()
    other = make_gpt(ffn="relu", scaled=False)
    with pytest.raises(CheckpointError, match=r"differs from the run's checkpoint \(ffn gelu_tanh -> relu, "
                                              r"scaled True -> False\)"):
        Trainer(other, cfg_factory(max_steps=4, save_every=2), toy_data, resume=True).fit()
    # what a resume may change (dropout: how it trains, not the function) still resumes
    Trainer(make_gpt(dropout=0.1), cfg_factory(max_steps=4, save_every=2), toy_data, resume=True).fit()


def test_training_checkpoints_follow_the_umask(make_gpt, toy_data, cfg_factory):
    """tempfile's owner-only modes (0700 folder, 0600 files) were kept by the renames."""
    import os

    from qkv.train import Trainer

    old = os.umask(0o022)
    try:
        step = Path(Trainer(make_gpt(), cfg_factory(max_steps=2, save_every=2), toy_data).fit()["checkpoint"])
    finally:
        os.umask(old)
    assert step.stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in step.iterdir()} == \
        {"config.json": 0o644, "model.safetensors": 0o644, "train_state.pt": 0o644}
