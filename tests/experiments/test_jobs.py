"""`qkv ablate --jobs N`: the runs of a grid trained N at a time in separate processes give the same results
as one after another (each run is seeded by its own spec), and a bad N is a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _clirun import run_cli
from qkv.config import ConfigError
from qkv.experiments.runner import run_suite

SUITE = {
    "name": "tiny_jobs",
    "family": "gpt",
    "model": {"preset": "gpt-nano", "d_model": 16, "n_heads": 2, "n_layers": 1},
    "task": {"name": "reverse", "min_len": 2, "max_len": 3},
    "train": {"max_steps": 20, "batch_size": 4, "log_every": 1, "lr": 1e-3},
    "grid": {"model.scaled": [True, False]},
    "seeds": [0, 1, 2],
    "metric": {"name": "exact_match", "goal": "max", "threshold": 0.5},
    "eval_n": 8,
    "extra_evals": [{"name": "len_4_5", "task": {"min_len": 4, "max_len": 5}}],
    # the --quick form is what the test runs: 4 runs of 6 steps
    "quick": {"train.max_steps": 6, "seeds": [0, 1]},
}


def _log(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_time_s", "time_s", "elapsed_s")}
            for r in rows]


def test_two_jobs_give_the_same_runs_as_one_and_resume(tmp_path):
    seq = run_suite(SUITE, tmp_path / "seq", quick=True, threads=1, log=None)
    # in parallel, in two goes: half the grid, then the whole suite (the finished half is skipped, as
    # sequentially: results are recorded run by run)
    run_suite(SUITE, tmp_path / "par", quick=True, threads=1, jobs=2, log=None, only="scaled=True")
    lines: list[str] = []
    par = run_suite(SUITE, tmp_path / "par", quick=True, threads=1, jobs=2, log=lines.append)
    assert sum("done earlier, skipped" in ln for ln in lines) == 2
    assert any("2 at a time" in ln for ln in lines)  # really ran in parallel, not the sequential path
    runs = sorted(p.name for p in (tmp_path / "seq" / "runs").iterdir())
    assert len(runs) == 4 and runs == sorted(p.name for p in (tmp_path / "par" / "runs").iterdir())
    for name in runs:
        a = json.loads((tmp_path / "seq" / "runs" / name / "result.json").read_text())
        b = json.loads((tmp_path / "par" / "runs" / name / "result.json").read_text())
        for key in ("metric", "final_loss", "eval", "extra", "steps", "params", "diverged"):
            assert a[key] == b[key], (name, key)
        # the whole training curve, step by step, not only the end point
        assert _log(tmp_path / "seq" / "runs" / name) == _log(tmp_path / "par" / "runs" / name)
    # the same table, in the same (file) order, whichever run finished first (wall time column left out)
    strip = [ln.rsplit("|", 2)[0] for ln in seq.read_text().splitlines() if ln.startswith("| ")]
    assert strip == [ln.rsplit("|", 2)[0] for ln in par.read_text().splitlines() if ln.startswith("| ")]


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True])
def test_jobs_below_one_is_a_clear_error(tmp_path, jobs):
    with pytest.raises(ConfigError, match="jobs must be a whole number >= 1"):
        run_suite(SUITE, tmp_path / "x", quick=True, jobs=jobs, log=None)
    assert not (tmp_path / "x").exists()  # refused before anything was written
    with pytest.raises(ConfigError, match="jobs must be a whole number >= 1"):
        run_suite(dict(SUITE, jobs=0), tmp_path / "y", quick=True, log=None)


def test_efficiency_suites_refuse_parallel_runs(tmp_path):
    suite = {"name": "eff", "kind": "efficiency", "family": "gpt", "model": {"preset": "gpt-nano"},
             "task": {"name": "reverse"}, "variants": [{"name": "a"}, {"name": "b"}],
             "metric": {"name": "step_ms"}}
    with pytest.raises(ConfigError, match="--jobs 1"):
        run_suite(suite, tmp_path, jobs=2, log=None)


def test_cli_jobs_zero_is_one_line_error():
    proc = run_cli("ablate", "04_norm_placement", "--quick", "--jobs", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("qkv: error:") and "--jobs" in proc.stderr
