"""Suite schema, grid expansion, the resumable runner and the report."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from qkv.config import ConfigError
from qkv.experiments.metrics import is_diverged, steps_to_threshold
from qkv.experiments.runner import run_suite
from qkv.experiments.suite import expand, load_suite

ROOT = Path(__file__).resolve().parents[2]

TINY = {
    "name": "tiny",
    "family": "gpt",
    "model": {"preset": "gpt-nano", "d_model": 16, "n_heads": 2, "n_layers": 1},
    "task": {"name": "reverse", "min_len": 2, "max_len": 3},
    "train": {"max_steps": 4, "batch_size": 4, "log_every": 1, "lr": 1e-3},
    "grid": {"model.scaled": [True, False], "train.warmup": [0, 2]},
    "seeds": [0, 1],
    "metric": {"name": "train_loss", "goal": "min", "threshold": 1.1},
    "quick": {"train.max_steps": 3, "seeds": [0]},
}


def _fake_train(calls):
    """A stand-in for the trainer: a loss curve that depends on the variant, written like the trainer's
    log."""

    def fn(suite, spec, run_dir):
        calls.append(spec.run_id)
        start = 3.0 if spec.values["scaled"] else 4.0
        losses = [start / (1 + 0.5 * s) + 0.01 * spec.seed for s in range(5)]
        with (run_dir / "metrics.jsonl").open("w") as f:
            for s, loss in enumerate(losses, 1):
                f.write(json.dumps({"step": s, "loss": loss}) + "\n")
        return {"metric": losses[-1], "final_loss": losses[-1], "diverged": False, "params": 10,
                "wall_s": 0.1,
                "steps_to_threshold": steps_to_threshold(list(enumerate(losses, 1)), 1.1, "min"), "steps": 5}

    return fn


def test_expand_grid_and_names():
    suite = load_suite(TINY)
    runs = expand(suite)
    assert len(runs) == 2 * 2 * 2
    assert runs[0].variant == "scaled=True,warmup=0" and runs[0].seed == 0 and runs[1].seed == 1
    assert runs[0].model["scaled"] is True and runs[2].train["warmup"] == 2
    assert len({r.run_id for r in runs}) == len(runs)
    assert TINY["model"].get("scaled") is None  # the base sections are not mutated


def test_quick_overrides_and_variant_sections():
    quick = load_suite(TINY, quick=True)
    assert quick.seeds == [0] and quick.train["max_steps"] == 3
    data = dict(TINY, variants=[{"name": "lstm", "model": {"family": "lstm"}}, {"name": "gpt"}], grid={})
    runs = expand(load_suite(data))
    assert [r.variant for r in runs] == ["lstm", "lstm", "gpt", "gpt"]
    assert runs[0].model == {"family": "lstm"} and runs[2].model["preset"] == "gpt-nano"


@pytest.mark.parametrize("bad, msg", [
    ({"grid": {"scaled": [True]}}, "must start with"),
    ({"metrc": {}}, "did you mean 'metric'"),
    ({"grid": {"model.scaled": []}}, "non-empty"),
    ({"variants": [{"model.x": 1}]}, "needs a 'name'"),
])
def test_bad_suites_are_clear_errors(bad, msg):
    with pytest.raises(ConfigError, match=msg):
        load_suite({**TINY, **bad})


def test_runner_table_one_row_per_variant_and_resumes(tmp_path):
    calls: list[str] = []
    summary = run_suite(TINY, tmp_path, train_fn=_fake_train(calls), log=None)
    assert len(calls) == 8
    text = summary.read_text()
    table = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert len(table) == 1 + 4  # header + one row per variant
    # mean +- std over seeds 0, 1 of the final loss: start/3 + {0, 0.01}
    assert f"{3.0 / 3 + 0.005:.3f} ± {math.sqrt(0.00005):.3f}" in text
    assert "steps to 1.1" in text and "never (0/2)" in text and "5 (2/2)" in text
    with (tmp_path / "results.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 8
    assert (tmp_path / "loss_curves.png").is_file() and (tmp_path / "metric_vs_scaled.png").is_file()
    # second run: every run is finished, nothing is trained again
    calls.clear()
    run_suite(TINY, tmp_path, train_fn=_fake_train(calls), log=None)
    assert calls == []
    # an interrupted run (no result.json) is redone, and only that one
    (tmp_path / "runs" / "scaled=False_warmup=2__seed1" / "result.json").unlink()
    run_suite(TINY, tmp_path, train_fn=_fake_train(calls), log=None)
    assert calls == ["scaled=False_warmup=2__seed1"]


def test_divergence_rule():
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}]
    assert not is_diverged(rows, None)
    assert is_diverged(rows + [{"step": 3, "loss": float("nan")}], None)
    assert is_diverged([{"step": 1, "loss": 3.0}, {"step": 2, "loss": 5.0}], None)
    assert is_diverged(rows, "NonFiniteError: loss is nan")


def test_quick_suite_with_the_real_trainer(tmp_path):
    pytest.importorskip("qkv.train", reason="trainer not available")
    from qkv.train import Trainer  # noqa: F401

    suite = dict(TINY, grid={"model.scaled": [True, False]}, seeds=[0],
                 metric={"name": "exact_match", "goal": "max", "threshold": 0.5}, eval_n=8,
                 extra_evals=[{"name": "len_2x", "task": {"min_len": 4, "max_len": 6}}])
    summary = run_suite(suite, tmp_path, log=None)
    text = summary.read_text()
    assert len([ln for ln in text.splitlines() if ln.startswith("| ")]) == 1 + 2
    res = json.loads((tmp_path / "runs" / "scaled=True__seed0" / "result.json").read_text())
    assert res["steps"] == 4 and 0.0 <= res["metric"] <= 1.0 and "len_2x" in res["extra"]
    run_dir = tmp_path / "runs" / "scaled=True__seed0"
    assert (run_dir / "run.json").is_file() and (run_dir / "metrics.jsonl").is_file()
    assert (run_dir / "final" / "model.safetensors").is_file() and not (run_dir / "checkpoints").exists()
    import qkv

    model = qkv.from_pretrained(run_dir / "final")
    assert model.config.scaled is True and model.config.context_length >= 6 + 6 + 2


def test_shipped_suites_load_and_expand():
    paths = sorted((ROOT / "configs" / "ablations").glob("*.yaml"))
    assert len(paths) >= 9
    for p in paths:
        for quick in (False, True):
            suite = load_suite(p, quick=quick)
            assert suite.claim and expand(suite)


def test_efficiency_suite_measures_every_variant(tmp_path):
    suite = {
        "name": "eff", "kind": "efficiency", "family": "gpt",
        "model": {"preset": "gpt-nano", "d_model": 16, "n_heads": 2, "n_layers": 1, "attention": "naive"},
        "task": {"name": "reverse", "min_len": 2, "max_len": 3}, "train": {"batch_size": 4},
        "variants": [{"name": "baseline"}, {"name": "ckpt+fused", "train.grad_checkpointing": True,
                                           "model.attention": "fused"}],
        "efficiency": {"steps": 2, "warmup_steps": 1, "isolate": False}, "metric": {"name": "step_ms"},
    }
    text = run_suite(suite, tmp_path, log=None, threads=1).read_text()
    assert len([ln for ln in text.splitlines() if ln.startswith("| ")]) == 1 + 2
    res = json.loads((tmp_path / "runs" / "ckpt+fused__seed0" / "result.json").read_text())
    assert res["error"] is None and res["step_ms"] > 0 and res["peak_mb"] >= 0 and res["params"] > 0
    assert "speedup" in (tmp_path / "summary.md").read_text()


def test_suite_by_name_and_unknown_name():
    assert load_suite("01_sqrt_dk").name == "sqrt_dk"
    with pytest.raises(ConfigError, match="nor a shipped suite: 01_sqrt_dk"):
        load_suite("no_such_suite")


# -- one way to build a run: the runner trains through qkv.run.train_run ------
def _strip(path):
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_time_s")} for r in rows]


def test_runner_builds_and_trains_runs_like_qkv_train(tmp_path):
    from qkv.experiments import parts
    from qkv.run import evaluate_run, train_run

    data = dict(TINY, grid={}, seeds=[3], metric={"name": "exact_match", "goal": "max"}, eval_n=4,
                train={**TINY["train"], "max_steps": 6, "save_every": 2})
    suite = load_suite(data)
    run_suite(suite, tmp_path / "suite", log=None)
    (spec,) = expand(suite)
    run_dir = tmp_path / "suite" / "runs" / spec.run_id
    direct = train_run(parts.run_config(suite, spec), out=tmp_path / "direct", quiet=True)
    # same seeding, same trajectory, bit for bit
    assert _strip(run_dir / "metrics.jsonl") == _strip(tmp_path / "direct" / "metrics.jsonl")
    res = json.loads((run_dir / "result.json").read_text())
    assert res["metric"] == direct["metrics"]["exact_match"]
    # the run folder is an ordinary qkv run folder
    assert (run_dir / "run.yaml").is_file() and (run_dir / "task.json").is_file()
    assert evaluate_run(run_dir / "final", n=4)["exact_match"] == res["metric"]


def test_interrupted_run_of_a_suite_is_resumed_not_restarted(tmp_path):
    from qkv.experiments import parts
    from qkv.run import train_run
    from qkv.train import StopAt

    data = dict(TINY, grid={}, seeds=[0], train={**TINY["train"], "max_steps": 6, "save_every": 2})
    suite = load_suite(data)
    (spec,) = expand(suite)
    run_dir = tmp_path / "suite" / "runs" / spec.run_id
    train_run(parts.run_config(suite, spec), out=run_dir, quiet=True, callbacks=[StopAt(4)])  # "interrupted"
    first = _strip(run_dir / "metrics.jsonl")
    assert max(r["step"] for r in first) == 4
    run_suite(suite, tmp_path / "suite", log=None)
    rows = _strip(run_dir / "metrics.jsonl")
    assert rows[: len(first)] == first and [r["step"] for r in rows] == list(range(1, 7))
    assert "resumed from" in (run_dir / "train.log").read_text()
    full = train_run(parts.run_config(suite, spec), out=tmp_path / "uninterrupted", quiet=True)
    assert rows == _strip(tmp_path / "uninterrupted" / "metrics.jsonl") and full["train"]["steps"] == 6
