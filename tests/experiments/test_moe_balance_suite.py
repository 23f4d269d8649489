"""Suite 14 (configs/ablations/14_moe_balance.yaml) and the suites' `logged:` key: the variants route as the
file's header says, a logged training-log key gets its column (mean +- std over seeds of its final value) and
its curve, and the quick size trains a variant end to end."""

from __future__ import annotations

import json
import math

import pytest

from qkv.config import ConfigError
from qkv.experiments import run_suite
from qkv.experiments.metrics import final_logged
from qkv.experiments.suite import expand, load_suite
from qkv.models.registry import build
from qkv.nn.moe import MoEFeedForward


def test_variants_differ_only_in_the_balancing():
    suite = load_suite("14_moe_balance")
    assert suite.logged == ["moe_maxvio"] and suite.metric.name == "val_loss"
    specs = [s for s in expand(suite) if s.seed == 0]
    assert [s.variant for s in specs] == ["none", "aux-loss", "bias", "both"]
    routing = {}
    for spec in specs:
        model = build(dict(spec.model))
        moe = model.config.moe
        layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
        assert len(layers) == model.config.n_layers  # every FFN routes
        assert (moe.n_experts, moe.n_experts_per_tok, moe.ffn_dim) == (8, 2, 64)
        routing[spec.variant] = (moe.score, moe.bias_balance, moe.aux_loss_coef)
    assert routing == {"none": ("softmax", False, 0.0), "aux-loss": ("softmax", False, 0.02),
                       "bias": ("sigmoid", True, 0.0), "both": ("sigmoid", True, 0.02)}
    assert len(expand(suite)) == 12 and len(expand(load_suite("14_moe_balance", quick=True))) == 4


def test_a_nested_dotted_override_stays_in_its_variant():
    suite = load_suite({**TINY, "model": {**TINY["model"], "moe": {"n_experts": 4}},
                        "variants": [{"name": "a", "model.moe.score": "sigmoid"}, {"name": "b"}]})
    models = {s.variant: s.model["moe"] for s in expand(suite) if s.seed == 0}
    assert models == {"a": {"n_experts": 4, "score": "sigmoid"}, "b": {"n_experts": 4}}
    assert suite.model["moe"] == {"n_experts": 4}


def test_final_logged_is_the_mean_of_the_last_tenth():
    rows = [{"step": s, "loss": 1.0, "x": float(s)} for s in range(1, 21)] + [{"step": 20, "eval/y": 1.0}]
    assert final_logged(rows, "x") == pytest.approx((19 + 20) / 2)
    assert math.isnan(final_logged(rows, "missing"))
    assert math.isnan(final_logged(rows + [{"step": 21, "x": float("nan")}], "x"))


def _fake_train(suite, spec, run_dir):
    """A stand-in for the trainer writing a log with an extra key: the last value is 0.5 + 0.1 * seed."""
    with (run_dir / "metrics.jsonl").open("w") as f:
        for s in range(1, 11):
            row = {"step": s, "loss": 2.0 / s, "balance": 3.0 / s + 0.2 + 0.1 * spec.seed}
            f.write(json.dumps(row) + "\n")
    return {"metric": 1.0, "final_loss": 0.2, "diverged": False, "params": 10, "wall_s": 0.1, "steps": 10}


TINY = {"name": "tiny", "family": "gpt", "model": {"preset": "gpt-nano", "d_model": 16, "n_heads": 2},
        "task": {"name": "reverse", "min_len": 2, "max_len": 3}, "train": {"max_steps": 10},
        "variants": [{"name": "a"}, {"name": "b", "train.lr": 1e-3}], "seeds": [0, 1],
        "metric": {"name": "exact_match", "goal": "max"}, "logged": ["balance"]}


def test_a_logged_key_gets_a_column_and_a_curve(tmp_path):
    summary = run_suite(TINY, tmp_path, train_fn=_fake_train, log=None).read_text()
    header = next(ln for ln in summary.splitlines() if ln.startswith("| variant"))
    assert "final balance" in header
    # seeds 0 and 1: 0.5 and 0.6 -> mean 0.55, sample std 0.0707
    assert summary.count(f"| 0.550 ± {math.sqrt(0.005):.3f} |") == 2
    assert (tmp_path / "logged_balance.png").is_file() and "logged_balance.png" in summary
    assert json.loads((tmp_path / "summary.json").read_text())[0]["final balance"].startswith("0.550")


def test_logged_must_be_a_list_of_names():
    with pytest.raises(ConfigError, match="logged"):
        load_suite({**TINY, "logged": "balance"})


def test_quick_size_trains_the_bias_variant_and_reports_its_balance(tmp_path):
    summary = run_suite("14_moe_balance", tmp_path, quick=True, only="bias", threads=1, log=None)
    res = json.loads((tmp_path / "runs" / "bias__seed0" / "result.json").read_text())
    assert res["error"] is None and res["steps"] == 15 and not res["diverged"]
    log = (tmp_path / "runs" / "bias__seed0" / "metrics.jsonl").read_text()
    rows = [json.loads(ln) for ln in log.splitlines()]
    vios = [r["moe_maxvio"] for r in rows if "moe_maxvio" in r]
    assert vios and all(0.0 <= v <= 3.0 for v in vios)  # 8 experts, top-2: E / k - 1 = 3 at worst
    assert "final moe_maxvio" in summary.read_text() and (tmp_path / "logged_moe_maxvio.png").is_file()
