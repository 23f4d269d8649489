"""Trainer settings that would do nothing useful: an evaluation interval with nothing to evaluate, a warmup as
long as the run."""

from __future__ import annotations

import pytest


def test_eval_every_with_nothing_to_evaluate_warns_and_logs_no_eval(tmp_path, make_gpt, toy_data, cfg_factory):
    """No evaluation function and max_eval_batches=0: eval_every used to log a fake eval loss of 0.0 and keep a
    'best' checkpoint by it; now it says so once and evaluates nothing."""
    from qkv.train import Trainer

    cfg = cfg_factory(max_steps=4, eval_every=2, max_eval_batches=0)
    with pytest.warns(UserWarning, match="train.eval_every=2 has nothing to evaluate"):
        trainer = Trainer(make_gpt(), cfg, toy_data)
    summary = trainer.fit()
    assert summary["best_eval"] is None and summary["best_checkpoint"] is None
    assert not any(k.startswith("eval/") for r in trainer.logger.records for k in r)


def test_a_warmup_as_long_as_the_run_is_flagged(make_gpt, toy_data, cfg_factory):
    """Not an error (a 2-step smoke run of a shipped config has warmup 100), but said: the cosine never starts."""
    from qkv.train import Trainer

    with pytest.warns(UserWarning, match="warmup of 8 steps >= max_steps=4: the cosine schedule never reaches"):
        Trainer(make_gpt(), cfg_factory(max_steps=4, warmup=8, schedule="cosine"), toy_data)
