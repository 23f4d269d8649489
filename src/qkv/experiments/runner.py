"""The grid runner: every (variant, seed) of a suite, one after another, resumable.

Layout of an output folder:
    OUT/suite.yaml                     the resolved suite (after --quick overrides)
    OUT/runs/<variant>__seed<k>/       one folder per run:
        run.json                       its model / task / train sections and seed (written first)
        metrics.jsonl, metrics.csv     the trainer's log (one JSON object per logged step)
        final/                         the final model (config.json + model.safetensors) and its
        task/tokenizer result.json                    written last, atomically: a run with result.json is
        finished
    OUT/results.csv, OUT/summary.md, OUT/*.png     the report (qkv.experiments.report)

A run whose folder has result.json is never redone (resumability), as long as its run.json holds the settings
the suite gives it now: a suite edited since (other steps, sizes, metric, ...) is refused before anything
trains, naming the run and the keys that differ (use another --out, or delete the run's folder to redo it). A
folder without result.json is a run that was interrupted: resumed from its newest checkpoint when it has one
(Ctrl-C checkpoints the current step), else started again from scratch. Each run is built and trained by
qkv.run.train_run, the function behind `qkv train`, so its folder is also an ordinary run folder (run.yaml,
task.json); the trainer's checkpoints/ are deleted when the run ends (keep_trainer_checkpoints keeps them),
so evaluate or load the final model: `qkv eval RUN_DIR/final`, `qkv.from_pretrained(RUN_DIR / "final")`.
Runs that diverge (non-finite loss, an exception from the trainer's NaN policy) are recorded as diverged, not
as crashes of the suite.

Seeds: a suite's `seeds` set train.seed, which draws the model's initialisation and dropout; the data (the
training batches and the held-out set) come from the task's own seed (task.seed, default 0), the same in every
run, so the spread over seeds is the spread over initialisations on one data stream. To vary the data too,
sweep it: `grid: {task.seed: [0, 1, 2]}` (one variant per data seed; each is also trained with every seed).

Before the first run starts, every run's settings are checked as `qkv train` checks them (model fields, task
options, Trainer and eval settings) and the suite's metric against the task's metrics, so a typo in the last
variant does not surface after the others have trained.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import shutil
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from qkv.checkpoint import save_model
from qkv.config import ConfigError, from_dict, to_dict
from qkv.experiments.efficiency import efficiency_run, interleaved_timing
from qkv.experiments.metrics import (
    final_train_loss,
    is_diverged,
    metric_series,
    read_metrics,
    steps_to_threshold,
)
from qkv.experiments.parts import extra_evals, run_config
from qkv.experiments.report import write_report
from qkv.experiments.selection import select_runs
from qkv.experiments.suite import RunSpec, Suite, check_jobs, expand, load_suite
from qkv.models.registry import config_for
from qkv.nn.params import count_parameters
from qkv.run import EvalSettings
from qkv.run import train_run as train
from qkv.run.folders import check_out_folder
from qkv.storage import atomic_write_text
from qkv.tasks.base import build_options, build_task, kind_for, task_spec
from qkv.train import Callback, TrainConfig, latest_checkpoint

RESULT = "result.json"
TrainFn = Callable[[Suite, RunSpec, Path], dict[str, Any]]


def _write_json(obj: Any, path: Path) -> None:
    atomic_write_text(json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n", path)


# -- one training run ---------------------------------------------------------------------------------------
def _budget_callback(seconds: float, clock: str = "wall"):
    """A trainer callback that ends training once `seconds` have passed since fit() started (equal-time
    comparisons, suite 8), on the wall clock or the process's CPU clock; max_steps stays an upper bound."""
    now = time.process_time if clock == "cpu" else time.perf_counter

    class TimeBudget(Callback):
        def on_fit_start(self, trainer: Any) -> None:
            self.t0 = now()

        def on_step_end(self, trainer: Any, step: int, record: dict[str, Any]) -> None:
            if now() - self.t0 > seconds:
                trainer.should_stop = True

    return TimeBudget()


def train_run(suite: Suite, spec: RunSpec, run_dir: Path) -> dict[str, Any]:
    """Train one run through qkv.run.train_run (the function behind `qkv train`: same seeding, validation
    and resume) and turn its outcome into the result record. A run folder holding a checkpoint (a run
    interrupted by Ctrl-C or a kill) is resumed, not restarted."""
    callbacks = [_budget_callback(suite.budget_s, suite.budget_clock)] if suite.budget_s else []
    resume = latest_checkpoint(run_dir / "checkpoints") is not None
    t0, c0 = time.perf_counter(), time.process_time()
    # keep_going: a NaN-policy stop is a measured outcome (diverged), not a crash of the suite
    out = train(run_config(suite, spec), out=run_dir, resume=resume, quiet=True, callbacks=callbacks,
                extra_evals=extra_evals(suite), keep_going=True)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    model, task, error = out["model"], out["task"], out["error"]
    rows = read_metrics(run_dir / "metrics.jsonl")
    result: dict[str, Any] = {"error": error, "wall_s": wall, "cpu_s": cpu, "params": count_parameters(model)}
    result["final_loss"] = final_train_loss(rows)
    result["diverged"] = is_diverged(rows, error)
    result["steps"] = max((int(r["step"]) for r in rows if "step" in r), default=0)
    finite_model = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    model.eval()
    if suite.metric.name == "train_loss":
        result["metric"] = result["final_loss"]
    elif finite_model:
        scores = out["metrics"]
        if suite.metric.name not in scores:
            raise ConfigError(f"suite {suite.name!r}: task {task.name!r} reports {sorted(scores)}, "
                              f"not {suite.metric.name!r}")
        result["metric"] = float(scores[suite.metric.name])
        result["eval"] = {k: float(v) for k, v in scores.items() if isinstance(v, (int, float))}
    else:
        result["metric"] = float("nan")
    result["extra"] = {
        name: float(scores.get(suite.metric.name, float("nan"))) if finite_model else float("nan")
        for name, scores in out["extra"].items()
    }
    for ev in suite.extra_evals:
        result["extra"].setdefault(ev.name, float("nan"))
    if suite.judge == "train_loss":  # the verdict from the training curve; the held-out metric kept beside it
        result["held_out"] = result["metric"]
        result["metric"] = result["final_loss"]
        series, goal = metric_series(rows, "train_loss"), "min"
    else:
        series, goal = metric_series(rows, suite.metric.name), suite.metric.goal
        if suite.metric.name != "train_loss" and math.isfinite(result["metric"]):
            series.append((result["steps"], result["metric"]))
    result["steps_to_threshold"] = steps_to_threshold(series, suite.metric.threshold, goal)
    if finite_model:
        save_model(model, run_dir / "final")
        task.save(run_dir / "final")
    if not suite.keep_trainer_checkpoints and (run_dir / "checkpoints").is_dir():
        shutil.rmtree(run_dir / "checkpoints")  # optimizer state x keep_last: most of a run's disk use
    return result


def _worker(train_fn: TrainFn, suite: Suite, spec: RunSpec, run_dir: Path, threads: int) -> dict[str, Any]:
    """One run in a worker process (spawned: a fresh interpreter, nothing inherited from the parent's
    torch)."""
    torch.set_num_threads(threads)
    return train_fn(suite, spec, run_dir)


def _run_parallel(suite: Suite, pending: list[tuple[int, RunSpec, Path]], total: int, train_fn: TrainFn,
                  jobs: int, threads: int | None, finish: Callable[..., None],
                  log: Callable[[str], None] | None) -> None:
    """Train the pending runs `jobs` at a time, each in its own process; results are recorded (result.json)
    as each run ends, so an interrupted suite resumes like a sequential one. train_fn must be picklable (a
    module-level function). The first failing run stops the suite (as sequentially), after the runs in
    flight end; runs not yet started are cancelled."""
    per_run = threads if threads is not None else max(1, torch.get_num_threads() // jobs)
    workers = min(jobs, len(pending))
    if log:
        log(f"{len(pending)} runs, {workers} at a time, {per_run} thread(s) each")
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {}
        for i, spec, run_dir in pending:
            futures[pool.submit(_worker, train_fn, suite, spec, run_dir, per_run)] = (i, spec, run_dir)
        if log:
            for i, spec, _ in pending:
                log(f"[{i + 1}/{total}] {spec.run_id} queued")
        todo = set(futures)
        try:
            while todo:
                finished, todo = wait(todo, return_when=FIRST_COMPLETED)
                for fut in finished:
                    i, spec, run_dir = futures[fut]
                    finish(i, spec, run_dir, fut.result())
        except BaseException:
            for fut in todo:
                fut.cancel()
            raise


# -- the suite ----------------------------------------------------------------------------------------------
def check_runs(suite: Suite, specs: list[RunSpec]) -> None:
    """Every run's settings checked as `qkv train` checks them, nothing built or trained: model fields (the
    family's config), task options, Trainer and eval settings, extra evaluations, and, for train suites, the
    metric against the task's metrics. Run before the first run starts: a typo in a later variant (or a
    misspelt metric) is an error now, not after the earlier runs have trained."""
    # (task name, family) -> the metric names its evaluate() reports
    tasks: dict[tuple[str, str], list[str]] = {}
    checked: set[str] = set()
    for spec in specs:
        if spec.variant in checked:  # the seed changes no setting that can be invalid
            continue
        checked.add(spec.variant)
        cfg = run_config(suite, spec)
        try:
            model = dict(cfg["model"])
            base = {k: model.pop(k) for k in ("preset", "family") if k in model}
            if not base:
                raise ConfigError("model needs 'preset' or 'family'")
            fam, _ = config_for(base, **model)
            options = dict(cfg["task"])
            if "name" not in options:
                raise ConfigError("task needs a 'name'")
            name = options.pop("name")
            kind_for(name, task_spec(name).kinds, fam.name)
            build_options(name, options)
            for ev in suite.extra_evals:
                build_options(name, {**options, **ev.task})
            from_dict(TrainConfig, cfg["train"], "train")
            from_dict(EvalSettings, cfg["eval"], "eval")
        except ConfigError as e:
            raise ConfigError(f"suite {suite.name!r}, variant {spec.variant!r}: {e}") from None
        if suite.kind != "train" or suite.metric.name == "train_loss":
            continue
        if (name, fam.name) not in tasks:  # built once per task: its class says what evaluate() reports
            tasks[(name, fam.name)] = list(build_task(name, family=fam.name, **options).metrics)
        if suite.metric.name not in tasks[(name, fam.name)]:
            raise ConfigError(f"suite {suite.name!r}: metric.name {suite.metric.name!r} is not a metric of "
                              f"task {name!r} (it reports {', '.join(tasks[(name, fam.name)])}; or use "
                              "train_loss)")


def run_record(suite: Suite, spec: RunSpec) -> dict[str, Any]:
    """What run.json holds: the settings that decide a run's result (its sections, seed, and how it is
    measured), compared with a finished run's saved one before that run is reused."""
    measure: dict[str, Any] = {"kind": suite.kind, "metric": to_dict(suite.metric), "judge": suite.judge,
                               "eval_n": suite.eval_n,
                               "extra_evals": [to_dict(ev) for ev in suite.extra_evals],
                               "budget_s": suite.budget_s, "budget_clock": suite.budget_clock}
    if suite.kind == "efficiency":
        measure["efficiency"] = to_dict(suite.efficiency)
    return {"suite": suite.name, "variant": spec.variant, "values": spec.values, "seed": spec.seed,
            "family": spec.family, "model": spec.model, "task": spec.task, "train": spec.train,
            "measure": measure}


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The dotted keys whose values differ, as 'key: old -> new' (measure.* shown without its prefix).
    Sections a run.json from an older qkv lacks (measure) are not compared."""
    now = json.loads(json.dumps(now, sort_keys=True, default=str))  # as it would be saved
    old = _flatten({k: v for k, v in saved.items() if k in now})
    new = _flatten({k: v for k, v in now.items() if k in saved})
    unset = object()
    out = []
    for key in sorted(set(old) | set(new), key=lambda k: (k.startswith("measure."), k)):
        a, b = old.get(key, unset), new.get(key, unset)
        if a != b:
            def show(v: Any) -> str:
                return "(unset)" if v is unset else json.dumps(v)

            out.append(f"{key.removeprefix('measure.')}: {show(a)} -> {show(b)}")
    return out


def check_saved_run(suite: Suite, spec: RunSpec, run_dir: Path) -> None:
    """A run folder kept from an earlier `qkv ablate` (finished, or interrupted with a checkpoint to resume)
    must have been run with the settings the suite gives it now: reusing it otherwise would put numbers of
    another configuration in the table."""
    path = run_dir / "run.json"
    if not path.is_file():
        return
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        saved = {"run.json": "(unreadable)"}
    diff = _differences(saved, run_record(suite, spec)) if isinstance(saved, dict) else ["run.json: not a "
                                                                                         "mapping"]
    if diff:
        shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
        raise ConfigError(f"{run_dir} was run with other settings than suite {suite.name!r} gives it now "
                          f"({shown}): use another --out, or delete runs/{spec.run_id} to redo it")


def run_suite(path_or_suite: str | Path | dict | Suite, out_dir: str | Path | None = None,
              quick: bool = False, *, scale: str = "cpu", only: str | None = None, force: bool = False,
              train_fn: TrainFn | None = None, threads: int | None = None, jobs: int | None = None,
              log: Callable[[str], None] | None = print) -> Path:
    """Run (or resume) every run of a suite and write the report; returns the path of summary.md.

    scale: "cpu" (the file as written) or "gpu" (its `scales: {gpu: ...}` profile).
    only: run just the runs this filter selects (see matches_only: comma-separated whole key=value items or
    variant names, e.g. "name=reverse,position=rope"; one that selects nothing is an error); the report
    still covers every finished run of the suite in out_dir. force: redo the selected runs even if finished.
    train_fn(suite, spec, run_dir) -> result dict: replaces the default trainer-based run (tests, custom
    measurements). Efficiency suites (kind: efficiency) use qkv.experiments.efficiency instead.
    threads: torch intra-op threads for the runs (torch.set_num_threads). On a machine shared with other
    jobs, 1 thread per process can be many times faster than oversubscribed cores.
    jobs: runs trained at once, each in its own (spawned) process on the same device (default: the suite's
    `jobs`, 1); each process gets `threads` threads, or its share of this process's threads. A run's result
    does not depend on jobs: each run is seeded by its own spec, whatever process trains it.

    The phases: load and check the suite, plan every run folder (nothing touched yet), prepare the folders,
    train the pending runs, time efficiency variants side by side, write the report."""
    suite = load_suite(path_or_suite, quick, scale)
    jobs = _check_parallel(suite, jobs, threads)
    out = Path(out_dir or Path("runs") / "ablations" / (suite.name + ("-quick" if quick else "") +
                                                        ("-gpu" if scale == "gpu" else "")))
    check_out_folder(out)
    specs = expand(suite)
    selected = select_runs(suite, specs, only)
    if train_fn is None:  # the runner's own runs: checked like `qkv train` before the first one starts
        check_runs(suite, specs)
        train_fn = _default_run(suite)
    plan = plan_runs(suite, specs, selected, out, force, resumes=train_fn is train_run, log=log)
    if threads is not None:
        torch.set_num_threads(threads)
    pending = _prepare_folders(suite, out, plan.todo)
    by_index = plan.finished

    def finish(i: int, spec: RunSpec, run_dir: Path, res: dict[str, Any]) -> None:
        res.update({"run_id": spec.run_id, "variant": spec.variant, "values": spec.values, "seed": spec.seed})
        _write_json(res, run_dir / RESULT)
        if log:
            m = res.get("metric")
            log(f"    {spec.run_id}: {suite.metric.name}={m if m is None else round(float(m), 4)} "
                f"diverged={res.get('diverged')} ({res.get('wall_s', 0):.1f}s)")
        by_index[i] = res

    if jobs == 1 or len(pending) <= 1:
        for i, spec, run_dir in pending:
            if log:
                log(f"[{i + 1}/{len(specs)}] {spec.run_id} ...")
            finish(i, spec, run_dir, train_fn(suite, spec, run_dir))
    else:
        _run_parallel(suite, pending, len(specs), train_fn, jobs, threads, finish, log)
    results = [by_index[i] for i in sorted(by_index)]  # file order, however the runs finished
    if log and len(results) < len(specs):
        log(f"the report covers the {len(results)} of {len(specs)} runs finished in {out}")
    interleaved = suite.kind == "efficiency" and suite.efficiency.interleave
    if interleaved and not torch.cuda.is_available() and results:
        _interleave(suite, specs, results, out, force, log)
    return write_report(suite, results, out, expected=len(specs))


def _check_parallel(suite: Suite, jobs: int | None, threads: int | None) -> int:
    """The number of runs trained at once (the suite's unless given), checked with the thread count."""
    jobs = suite.jobs if jobs is None else check_jobs(jobs)
    if jobs > 1 and suite.kind == "efficiency":
        raise ConfigError(f"suite {suite.name!r} times its runs (kind: efficiency): run it with --jobs 1, "
                          "parallel runs would share the device and distort the timings")
    if threads is not None and threads < 1:
        raise ConfigError(f"threads must be at least 1, got {threads}")
    return jobs


def _default_run(suite: Suite) -> TrainFn:
    """The run function of a suite's kind: a timing run for efficiency suites, a training run otherwise."""
    if suite.kind == "efficiency":
        return efficiency_run
    return train_run


@dataclass
class Plan:
    """What happens to every run folder, decided before any is touched: the results of runs finished
    earlier (by index), and the runs to train now as (index, spec, folder, delete the folder first)."""

    finished: dict[int, dict[str, Any]] = field(default_factory=dict)
    todo: list[tuple[int, RunSpec, Path, bool]] = field(default_factory=list)


def plan_runs(suite: Suite, specs: list[RunSpec], selected: set[int], out: Path, force: bool, *,
              resumes: bool, log: Callable[[str], None] | None = None) -> Plan:
    """Decide every run folder's fate before touching any, so a refused one leaves the folders as they were.
    resumes: the run function continues an unfinished run from its checkpoint (train_run does; other run
    functions start it again)."""
    plan = Plan()
    for i, spec in enumerate(specs):
        run_dir = out / "runs" / spec.run_id
        done = run_dir / RESULT
        redo = force and i in selected
        resumable = resumes and latest_checkpoint(run_dir / "checkpoints") is not None
        # kept: its settings must still hold
        if not redo and (done.is_file() or (i in selected and resumable)):
            check_saved_run(suite, spec, run_dir)
        if i not in selected:  # not run now; reported when it finished earlier (the report covers the suite)
            if done.is_file():
                plan.finished[i] = json.loads(done.read_text(encoding="utf-8"))
            continue
        if done.is_file() and not redo:
            if log:
                log(f"[{i + 1}/{len(specs)}] {spec.run_id}: done earlier, skipped")
            plan.finished[i] = json.loads(done.read_text(encoding="utf-8"))
            continue
        plan.todo.append((i, spec, run_dir, run_dir.exists() and (redo or done.is_file() or not resumable)))
    return plan


def _prepare_folders(suite: Suite, out: Path,
                     todo: list[tuple[int, RunSpec, Path, bool]]) -> list[tuple[int, RunSpec, Path]]:
    """Write OUT/suite.yaml and each pending run's folder with its run.json; returns the pending runs."""
    (out / "runs").mkdir(parents=True, exist_ok=True)
    atomic_write_text(yaml.safe_dump(to_dict(suite), sort_keys=False), out / "suite.yaml")
    pending: list[tuple[int, RunSpec, Path]] = []
    for i, spec, run_dir, wipe in todo:
        if wipe:
            shutil.rmtree(run_dir)  # an interrupted run without a checkpoint, or --force: start it again
        run_dir.mkdir(parents=True, exist_ok=True)  # one with a checkpoint: train_run resumes it
        _write_json(run_record(suite, spec), run_dir / "run.json")
        pending.append((i, spec, run_dir))
    return pending


def _interleave(suite: Suite, specs: list[RunSpec], results: list[dict[str, Any]], out: Path, force: bool,
                log: Callable[[str], None] | None) -> None:
    """An efficiency suite on a CPU: its step times measured again with the variants' steps interleaved
    (cached in OUT/interleaved.json), replacing each result's isolated time (kept as step_ms_isolated)."""
    cache = out / "interleaved.json"
    variants = sorted({r["variant"] for r in results})
    timing = json.loads(cache.read_text(encoding="utf-8")) if cache.is_file() else {}
    if sorted(timing) != variants or force:
        if log:
            log("timing the variants side by side (interleaved steps) ...")
        timing = interleaved_timing(suite, [s for s in specs if s.variant in variants])
        _write_json(timing, cache)
    for r in results:
        if r["variant"] in timing and r.get("step_ms"):
            r.setdefault("step_ms_isolated", r["step_ms"])
            r["step_ms"] = timing[r["variant"]]
            r["tokens_per_s"] = r["batch_tokens"] / (r["step_ms"] / 1000)
            r["metric"] = r["step_ms"]
