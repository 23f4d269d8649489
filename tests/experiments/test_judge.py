"""judge: train_loss: the verdict column comes from the training curve (for models that memorise their
corpus), while the held-out metric is still measured and shown beside it with the gap."""

from __future__ import annotations

import json

import pytest

from qkv.config import ConfigError
from qkv.experiments.runner import run_suite
from qkv.experiments.suite import load_suite

TEXT = "the quick brown fox jumps over the lazy dog. " * 40 + "pack my box with five dozen liquor jugs. " * 10


def _suite(path, judge):
    return {
        "name": "judge", "family": "gpt", "judge": judge,
        "model": {"preset": "gpt-nano", "d_model": 16, "n_heads": 2, "n_layers": 1},
        "task": {"name": "charlm", "path": str(path), "context": 16},
        "train": {"max_steps": 20, "batch_size": 4, "log_every": 1, "lr": 3e-3},
        "seeds": [0], "eval_n": 4, "metric": {"name": "val_loss", "goal": "min", "threshold": 2.8},
    }


def test_judged_on_the_training_curve_with_the_held_out_loss_beside_it(tmp_path):
    corpus = tmp_path / "text.txt"
    corpus.write_text(TEXT)
    summary = run_suite(_suite(corpus, "train_loss"), tmp_path / "out", threads=1, log=None)
    run_dir = tmp_path / "out" / "runs" / "base__seed0"
    res = json.loads((run_dir / "result.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    losses = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    assert len(losses) == 20
    tail = [v for _, v in losses[-2:]]  # the last 10% of 20 logged losses
    assert res["metric"] == pytest.approx(sum(tail) / 2)
    assert res["held_out"] == res["eval"]["val_loss"]  # the held-out loss was measured, not dropped
    first = next((s for s, v in losses if v <= 2.8), None)
    assert res["steps_to_threshold"] == first
    text = summary.read_text()
    header = next(ln for ln in text.splitlines() if ln.startswith("| "))
    assert "train_loss (judged)" in header and "held-out val_loss" in header and "| gap |" in header
    assert "final train loss" not in header and "Judged on the training curve" in text


def test_judge_defaults_to_the_metric_and_is_checked(tmp_path):
    base = _suite(tmp_path / "x.txt", "metric")
    assert load_suite({k: v for k, v in base.items() if k != "judge"}).judge == "metric"
    with pytest.raises(ConfigError):
        load_suite({**base, "judge": "val"})
    with pytest.raises(ConfigError, match="judge: train_loss needs a held-out metric"):
        load_suite({**base, "judge": "train_loss", "metric": {"name": "train_loss"}})


def test_the_gpu_profile_of_suite_04_is_judged_on_the_training_curve():
    assert load_suite("04_norm_placement", scale="gpu").judge == "train_loss"
    assert load_suite("04_norm_placement").judge == "metric"
