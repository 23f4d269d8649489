"""The ablation runner's selection and checks: --only (whole items, a report of the whole suite), finished
runs reused only with the settings they were run with, everything checked before the first run trains, run
folders that cannot collide, one-line errors for a bad --out, budget or empty suite, and what a suite's seeds
vary."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from qkv.config import ConfigError
from qkv.experiments.parts import build_run
from qkv.experiments.runner import run_suite
from qkv.experiments.suite import expand, load_suite

TINY = {
    "name": "tiny",
    "family": "gpt",
    "model": {"preset": "gpt-nano", "d_model": 32, "n_heads": 2, "n_layers": 1},
    "task": {"name": "reverse", "min_len": 2, "max_len": 3},
    "train": {"max_steps": 3, "batch_size": 4, "log_every": 1, "lr": 1e-3},
    "grid": {"model.scaled": [True, False], "model.n_heads": [1, 16]},
    "seeds": [0],
    "metric": {"name": "train_loss", "goal": "min"},
}


def _fake_train(calls):
    """A stand-in for the trainer (module tests of the runner's bookkeeping, no training)."""

    def fn(suite, spec, run_dir):
        calls.append(spec.run_id)
        loss = (3.0 if spec.values["scaled"] else 4.0) / spec.values["n_heads"]
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": loss}) + "\n")
        return {"metric": loss, "final_loss": loss, "diverged": False, "params": 10, "wall_s": 0.1,
                "steps": 1}

    return fn


def _table(summary: Path) -> list[str]:
    return [ln for ln in summary.read_text().splitlines() if ln.startswith("| ") and "variant" not in ln]


# -- --only: whole key=value items; the report still covers the whole suite ----------------------------------
def test_only_keeps_the_report_of_every_finished_run(tmp_path):
    calls: list[str] = []
    run_suite(TINY, tmp_path, train_fn=_fake_train(calls), log=None)
    assert len(calls) == 4
    calls.clear()
    summary = run_suite(TINY, tmp_path, train_fn=_fake_train(calls), log=None, only="scaled=True", force=True)
    # only those redone
    assert sorted(calls) == ["scaled=True_n_heads=16__seed0", "scaled=True_n_heads=1__seed0"]
    assert len(_table(summary)) == 4  # ... but the report still has every variant
    with (tmp_path / "results.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 4
    assert len(json.loads((tmp_path / "summary.json").read_text())) == 4
    assert "Partial" not in summary.read_text()


def test_only_on_a_fresh_folder_says_the_report_is_partial(tmp_path):
    summary = run_suite(TINY, tmp_path, train_fn=_fake_train([]), log=None, only="scaled=False")
    assert len(_table(summary)) == 2 and "Partial: 2 of the suite's 4 runs" in summary.read_text()


def test_only_matches_whole_key_value_items(tmp_path):
    from qkv.experiments.selection import matches_only

    calls: list[str] = []
    run_suite(TINY, tmp_path, train_fn=_fake_train(calls), log=None, only="n_heads=1")
    # not n_heads=16
    assert sorted(calls) == ["scaled=False_n_heads=1__seed0", "scaled=True_n_heads=1__seed0"]
    specs = {s.variant: s for s in expand(load_suite(TINY))}
    one = specs["scaled=True,n_heads=1"]
    # the documented syntax: several items, each a whole key=value of the name, written as shown or as YAML
    assert matches_only(one, "scaled=True,n_heads=1") and matches_only(one, "n_heads=1,scaled=true")
    assert not matches_only(specs["scaled=True,n_heads=16"], "scaled=True,n_heads=1")
    assert not matches_only(one, "n_heads=1,scaled=False") and not matches_only(one, "heads=1")
    lr = load_suite({**TINY, "grid": {"train.lr": [1e-3, 1e-2]}})
    assert [s.variant for s in expand(lr) if matches_only(s, "lr=1e-3")] == ["lr=0.001"]
    named = load_suite({**TINY, "grid": {}, "variants": [{"name": "lstm"}, {"name": "lstm2"}]})
    assert [s.variant for s in expand(named) if matches_only(s, "lstm")] == ["lstm"]
    assert [s.variant for s in expand(named) if matches_only(s, "variant=lstm2")] == ["lstm2"]


def test_only_that_matches_nothing_is_an_error_naming_the_variants(tmp_path):
    with pytest.raises(ConfigError, match=r"--only 'n_heads=4' matches no run .*scaled=True,n_heads=1; "):
        run_suite(TINY, tmp_path, train_fn=_fake_train([]), log=None, only="n_heads=4")
    assert not (tmp_path / "runs").exists()


# -- a finished run is reused only with the settings it was run with -----------------------------------------
def test_finished_run_with_other_settings_is_refused_before_training(tmp_path):
    calls: list[str] = []
    run_suite(TINY, tmp_path, train_fn=_fake_train(calls), log=None)
    calls.clear()
    changed = {**TINY, "train": {**TINY["train"], "max_steps": 5}}
    with pytest.raises(ConfigError, match=r"scaled=True_n_heads=1__seed0 was run with other settings .*"
                                          r"train\.max_steps: 3 -> 5.*use another --out, or delete "
                                          r"runs/scaled=True_n_heads=1__seed0 to redo it"):
        run_suite(changed, tmp_path, train_fn=_fake_train(calls), log=None)
    assert calls == []
    # how a run is measured counts too
    with pytest.raises(ConfigError, match=r"metric\.threshold: null -> 0\.5"):
        run_suite({**TINY, "metric": {**TINY["metric"], "threshold": 0.5}}, tmp_path,
                  train_fn=_fake_train(calls), log=None)
    # unchanged settings: reused; --force redoes the runs instead of comparing them
    run_suite(TINY, tmp_path, train_fn=_fake_train(calls), log=None)
    assert calls == []
    run_suite(changed, tmp_path, train_fn=_fake_train(calls), log=None, force=True)
    assert len(calls) == 4


# -- run folders cannot collide ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, msg", [
    ({"grid": {}, "variants": [{"name": "a b"}, {"name": "a/b"}]},
     "variants 'a b' and 'a/b' would share the run "
     "folder runs/a_b__seed"),
    ({"grid": {"model.n_heads": [1, 2, 1]}}, r"grid\['model.n_heads'\] lists the value 1 twice"),
    ({"seeds": [0, 0]}, "repeat a seed"),
])
def test_colliding_run_folders_are_refused(bad, msg):
    with pytest.raises(ConfigError, match=msg):
        load_suite({**TINY, **bad})


# -- everything checked before the first run trains ----------------------------------------------------------
@pytest.mark.parametrize("bad, msg", [
    ({"metric": {"name": "exact_matc", "goal": "max"}}, "metric.name 'exact_matc' is not a metric of task "
                                                        "'reverse' .*exact_match"),
    ({"grid": {}, "variants": [{"name": "a"}, {"name": "b", "model.n_haeds": 4}]},
     "variant 'b': unknown key 'n_haeds'.*did you mean 'n_heads'"),
    ({"grid": {"train.lr": [1e-3], "task.max_lenn": [4]}}, "unknown key 'max_lenn'"),
    ({"grid": {"train.warmpu": [0]}}, "unknown key 'warmpu'"),
])
def test_typos_are_caught_before_any_run_trains(tmp_path, bad, msg):
    with pytest.raises(ConfigError, match=msg):
        run_suite({**TINY, "grid": {"model.scaled": [True]}, "eval_n": 4, **bad}, tmp_path, log=None,
                  threads=1)
    assert not (tmp_path / "runs").exists()  # nothing trained, nothing written


def _shipped_suites() -> list[str]:
    from importlib import resources

    folder = resources.files("qkv") / "configs" / "ablations"
    return sorted(q.name[:-5] for q in folder.iterdir() if q.name.endswith(".yaml"))


@pytest.mark.parametrize("profile", [{"quick": False}, {"quick": True}], ids=["full", "quick"])
@pytest.mark.parametrize("name", _shipped_suites())
def test_every_shipped_suite_passes_the_up_front_checks(name, profile):
    from qkv.experiments.runner import check_runs
    from qkv.tasks.images import FASHION_APT, FASHION_DIR

    suite = load_suite(name, **profile)
    try:
        check_runs(suite, expand(suite))
    except ConfigError as e:  # the checks build the task, which reads its data's shape
        if Path(FASHION_DIR).is_dir() or FASHION_APT not in str(e):
            raise
        pytest.skip(f"Fashion-MNIST is not installed ({FASHION_APT})")


# -- a bad --out, budget or suite: one-line errors -----------------------------------------------------------
def test_out_that_is_a_file_is_a_one_line_error(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        run_suite(TINY, f, train_fn=_fake_train([]), log=None)
    with pytest.raises(ConfigError, match="afile is a file, not a folder"):
        run_suite(TINY, f / "sub", train_fn=_fake_train([]), log=None)


@pytest.mark.parametrize("budget", [-5, 0, 0.0, float("inf")])
def test_budget_must_be_positive_or_null(budget):
    with pytest.raises(ConfigError, match="budget_s must be a number of seconds > 0, or null"):
        load_suite({**TINY, "budget_s": budget})
    assert load_suite({**TINY, "budget_s": None}).budget_s is None
    assert load_suite({**TINY, "budget_s": 1.5}).budget_s == 1.5


def test_empty_suite_names_the_missing_sections(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="has no model: and no task: section"):
        load_suite(empty)
    with pytest.raises(ConfigError, match="has no task: section"):
        load_suite({"name": "x", "model": {"preset": "gpt-nano"}})


# -- a suite's seeds vary the initialisation, task.seed the data (documented in docs/ablations.md) -----------
def test_seeds_vary_the_weights_and_a_task_seed_grid_varies_the_data():
    suite = load_suite({**TINY, "grid": {"task.seed": [0, 1]}, "seeds": [0, 1]})
    specs = expand(suite)
    assert [s.run_id for s in specs] == ["seed=0__seed0", "seed=0__seed1", "seed=1__seed0", "seed=1__seed1"]
    built = [build_run(suite, s) for s in specs]
    data = [task.batch(0, 8, "train")["input_ids"] for _, task, _ in built]
    first = [next(model.parameters()).detach() for model, _, _ in built]
    assert torch.equal(data[0], data[1]) and not torch.equal(first[0], first[1])  # seeds: same data, new init
    assert not torch.equal(data[0], data[2]) and torch.equal(first[0], first[2])  # task.seed: new data
