"""Ablation suites: one YAML file = one claim of the articles, turned into a grid of training runs.

    name: sqrt_dk
    claim: "..."                     # the sentence of the article being tested (quoted in docs/ablations.md)
    source: "seed 000, 2.2"
    kind: train                      # train (train + evaluate each run) | efficiency (time + memory of steps)
    family: gpt                      # model family the task's batches are built for
    model: {preset: gpt-nano, d_model: 64}          # preset or family + config fields
    task: {name: reverse, min_len: 4, max_len: 8}   # task name + its options
    train: {max_steps: 300, lr: 1e-3}               # TrainConfig fields (the fixed budget)
    grid:                            # cartesian product of dotted overrides into model / train / task
      model.scaled: [true, false]
      model.n_heads: [16, 4, 1]
    variants:                        # optional explicit variants (crossed with the grid); each a name plus
      - {name: lstm, family: lstm, model: {preset: lstm-tiny}}   # dotted overrides, a whole section
                                                                 # (model/task/train), or another family
    seeds: [0, 1]                    # train.seed of each run: the initialisation and dropout; the data
    (batches,
                                     # held-out set) follow task.seed, the same in every run (grid task.seed)
    metric: {name: exact_match, goal: max, threshold: 0.9}   # a key of task.evaluate(), or train_loss
    judge: metric                    # metric | train_loss: the verdict from the training curve, the held-out
                                     # metric still measured and shown beside it (memorisation gap)
    logged: [moe_maxvio]             # training-log keys shown per variant (mean of the last 10% of logged
                                     # values) and drawn over steps (logged_<key>.png)
    eval_n: 200
    extra_evals: [{name: len_2x, task: {min_len: 9, max_len: 16}}]   # same model, other task options
    budget_s: null                   # time cap per run in seconds, > 0 (equal-time comparisons); null: none
    budget_clock: wall               # wall: elapsed time | cpu: the run's own CPU time (a shared machine)
    jobs: 1                          # runs trained at once, each in its own process (`qkv ablate --jobs N`)
    quick: {train.max_steps: 10, seeds: [0]}        # overrides of this file for the < 1 minute version
    scales:                          # named size profiles (`qkv ablate SUITE --scale gpu`), overrides as in
      gpu: {model.n_layers: 16, train.max_steps: 2000, seeds: [0, 1, 2]}   # quick; the file itself is `cpu`

Everything is checked strictly (qkv.config.from_dict): a misspelt key names the closest valid one.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from qkv.config import ConfigError, apply_overrides, from_dict, load_yaml, to_dict

SECTIONS = ("model", "train", "task")


@dataclass
class MetricSpec:
    name: str = "train_loss"  # a key of task.evaluate(model), or train_loss (mean of the last logged losses)
    goal: Literal["min", "max"] = "min"  # which direction is better
    # "steps to reach": first logged step where the metric is at least this good
    threshold: float | None = None


@dataclass
class ExtraEval:
    name: str  # column name in the table, e.g. len_2x
    task: dict[str, Any] = field(default_factory=dict)  # task option overrides (same tokenizer as training)
    n: int | None = None  # examples (default: the suite's eval_n)


@dataclass
class EfficiencySpec:
    steps: int = 10  # timed optimizer steps per variant
    warmup_steps: int = 2  # untimed steps first (allocator, autotuning)
    batch_size: int | None = None  # default: train.batch_size
    isolate: bool = True  # a fresh process per variant (its own peak memory); false: in this process (tests)
    interleave: bool = True  # step time re-measured in one process, variants interleaved (CPU only)


@dataclass
class Suite:
    name: str
    model: dict[str, Any]
    task: dict[str, Any]
    claim: str = ""
    source: str = ""
    kind: Literal["train", "efficiency"] = "train"
    family: str | None = None
    train: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    variants: list[dict[str, Any]] = field(default_factory=list)
    seeds: list[int] = field(default_factory=lambda: [0])
    metric: MetricSpec = field(default_factory=MetricSpec)
    eval_n: int = 200
    # keys of the trainer's metrics.jsonl (e.g. moe_maxvio, aux_loss) reported beside the metric: their final
    # value (mean of the last 10% logged, as train_loss) per variant, and their curves over steps
    logged: list[str] = field(default_factory=list)
    # what the table's verdict column is: "metric" (the held-out metric above) or "train_loss" (the training
    # curve: final train loss, steps to the threshold on the logged losses). For models big enough to memorise
    # the corpus, where the held-out loss measures overfitting rather than whether training converged; the
    # held-out metric is still measured and reported beside it, with the gap between the two.
    judge: Literal["metric", "train_loss"] = "metric"
    extra_evals: list[ExtraEval] = field(default_factory=list)
    budget_s: float | None = None
    # which clock budget_s counts: "wall" (elapsed time, what a user waits for) or "cpu" (the process's own
    # CPU
    # time: on a machine shared with other jobs, with 1 thread per run, the compute each run actually got,
    # so that an equal-time comparison is not decided by what else happened to be running)
    budget_clock: Literal["wall", "cpu"] = "wall"
    # runs of the grid trained at once on one device, each in its own process (--jobs overrides)
    jobs: int = 1
    efficiency: EfficiencySpec = field(default_factory=EfficiencySpec)
    quick: dict[str, Any] = field(default_factory=dict)
    scales: dict[str, dict[str, Any]] = field(default_factory=dict)  # size profiles; the file itself is "cpu"
    notes: str = ""  # free text carried into the report
    # keep each run's checkpoints/ (optimizer state); final/ is always kept
    keep_trainer_checkpoints: bool = False

    def validate(self) -> None:
        if "name" not in self.task:
            raise ConfigError(f"suite {self.name!r}: task needs a 'name'")
        if "preset" not in self.model and "family" not in self.model:
            raise ConfigError(f"suite {self.name!r}: model needs 'preset' or 'family'")
        for key, values in self.grid.items():
            _check_dotted(key, self.name)
            if not isinstance(values, list) or not values:
                raise ConfigError(f"suite {self.name!r}: grid[{key!r}] must be a non-empty list")
        names = set()
        for v in self.variants:
            if not isinstance(v, dict):
                raise ConfigError(f"suite {self.name!r}: each variant must be a mapping")
            if "name" not in v:
                raise ConfigError(f"suite {self.name!r}: each variant needs a 'name'")
            if v["name"] in names:
                raise ConfigError(f"suite {self.name!r}: variant name {v['name']!r} is repeated")
            names.add(v["name"])
            for key in v:
                if key not in ("name", "family") and key not in SECTIONS:
                    _check_dotted(key, self.name)
        if not self.seeds:
            raise ConfigError(f"suite {self.name!r}: seeds must not be empty")
        if len(set(self.seeds)) < len(self.seeds):  # one folder per (variant, seed): a repeat is the same run
            raise ConfigError(f"suite {self.name!r}: seeds {self.seeds} repeat a seed")
        self._check_run_ids()
        # 0 or a negative budget would stop every run after its first step; null is the way to say "no budget"
        if self.budget_s is not None and (isinstance(self.budget_s, bool) or not self.budget_s > 0
                                          or not math.isfinite(self.budget_s)):
            raise ConfigError(f"suite {self.name!r}: budget_s must be a number of seconds > 0, or null for "
                              f"no time budget, got {self.budget_s!r}")
        if self.eval_n < 1:
            raise ConfigError(f"suite {self.name!r}: eval_n must be >= 1")
        check_jobs(self.jobs, f"suite {self.name!r}: jobs")
        if self.judge == "train_loss" and self.metric.name == "train_loss":
            raise ConfigError(f"suite {self.name!r}: judge: train_loss needs a held-out metric to report "
                              f"beside it (metric.name is train_loss already; leave judge at 'metric')")

    def _check_run_ids(self) -> None:
        """Each variant has its own run folder: the folder name is the variant's name with punctuation turned
        into '_' (_slug), so two names that differ only there, or a grid value listed twice, would make two
        variants share (and overwrite) one folder."""
        for key, values in self.grid.items():
            shown = [format_value(v) for v in values]
            for v in shown:
                if shown.count(v) > 1:
                    raise ConfigError(f"suite {self.name!r}: grid[{key!r}] lists the value {v} twice")
        folders: dict[str, str] = {}
        for name in variant_names(self):
            slug = _slug(name)
            if slug in folders and folders[slug] != name:
                raise ConfigError(f"suite {self.name!r}: variants {folders[slug]!r} and {name!r} would share "
                                  f"the run folder runs/{slug}__seed*: rename one (folder names keep only "
                                  f"letters, digits and _ . = + -)")
            folders[slug] = name


def check_jobs(jobs: Any, what: str = "--jobs") -> int:
    """jobs as an int >= 1, or a ConfigError that says what was given."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"{what} must be a whole number >= 1 (runs trained at once), got {jobs!r}")
    return jobs


def _check_dotted(key: str, suite: str) -> None:
    head = key.split(".", 1)[0]
    if head not in SECTIONS or "." not in key:
        raise ConfigError(f"suite {suite!r}: override key {key!r} must start with one of "
                          f"{', '.join(s + '.' for s in SECTIONS)}")


SCALES = ("cpu", "gpu")


def load_suite(path_or_suite: str | Path | dict | Suite, quick: bool = False, scale: str = "cpu") -> Suite:
    """A Suite from a YAML path, a mapping or a Suite; quick=True applies its `quick:` overrides, scale="gpu"
    its `scales: {gpu: ...}` profile (model sizes, steps, seeds where the articles' claims were made)."""
    if scale not in SCALES:
        raise ConfigError(f"scale must be one of {list(SCALES)}, got {scale!r}")
    if quick and scale != "cpu":
        raise ConfigError("--quick and --scale gpu exclude each other (quick is the smallest cpu size)")
    if isinstance(path_or_suite, Suite):
        data = to_dict(path_or_suite)
    elif isinstance(path_or_suite, dict):
        data = dict(path_or_suite)
    else:
        p = Path(path_or_suite)
        if not p.is_file():
            shipped = resources.files("qkv") / "configs" / "ablations"  # package data: works from a wheel too
            bundled = shipped / (f"{p.name}.yaml" if not p.suffix else p.name)
            if bundled.is_file():
                p = Path(str(bundled))
            else:
                names = sorted(q.name[:-5] for q in shipped.iterdir() if q.name.endswith(".yaml")) \
                    if shipped.is_dir() else []
                raise ConfigError(f"suite not found: {path_or_suite} (not a file" + (
                    f", nor a shipped suite: {', '.join(names)})" if names else ")"))
        data = load_yaml(p)
        data.setdefault("name", p.stem)
    # an empty file, or one without the two sections every suite needs: name them, not the dataclass's
    # arguments
    missing = [k for k in ("model", "task") if k not in data]
    if missing:
        where = f" ({path_or_suite})" if isinstance(path_or_suite, (str, Path)) else ""
        raise ConfigError(f"suite {data.get('name', '?')!r}{where} has no "
                          f"{' and no '.join(s + ':' for s in missing)} section (a suite needs at least "
                          "model: and task:; see docs/ablations.md)")
    suite = from_dict(Suite, data, "suite")
    if quick:
        if not suite.quick:
            raise ConfigError(f"suite {suite.name!r} has no 'quick:' section")
        suite = _apply_profile(suite, suite.quick, "quick")
    if scale != "cpu":
        if scale not in suite.scales:
            raise ConfigError(f"suite {suite.name!r} has no '{scale}' profile under 'scales:'"
                              + (f" (it has: {', '.join(suite.scales)})" if suite.scales else ""))
        suite = _apply_profile(suite, suite.scales[scale], f"scales.{scale}")
    return suite


def _apply_profile(suite: Suite, profile: dict[str, Any], what: str) -> Suite:
    """The suite with a profile's overrides: a plain key replaces that field (a whole section, the grid,
    the seeds), a dotted key (model.n_layers) changes one value inside a section."""
    data = to_dict(suite)
    nested = {k: v for k, v in profile.items() if "." in k}
    for k, v in profile.items():
        if "." not in k:
            data[k] = v
    apply_overrides(data, nested, f"suite {suite.name!r} {what}")
    return from_dict(Suite, data, "suite")


@dataclass
class RunSpec:
    """One training run of a suite: a variant (its overrides) and a seed."""

    suite: str
    variant: str  # display name, e.g. "scaled=False,n_heads=16"
    values: dict[str, Any]  # the swept values (short column name -> value)
    seed: int
    model: dict[str, Any]
    task: dict[str, Any]
    train: dict[str, Any]
    family: str | None

    @property
    def run_id(self) -> str:
        return f"{_slug(self.variant)}__seed{self.seed}"


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", s).strip("_") or "base"


def _short(key: str) -> str:
    return key.split(".", 1)[1]


def format_value(v: Any) -> str:
    return "null" if v is None else str(v)


def _apply_variant(sections: dict[str, dict[str, Any]], overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        if key in ("name", "family"):
            continue
        if key in SECTIONS:  # a whole section replaced (e.g. another model family)
            if not isinstance(value, dict):
                raise ConfigError(f"variant section {key!r} must be a mapping")
            sections[key] = dict(value)
        else:
            head, rest = key.split(".", 1)
            apply_overrides(sections[head], {rest: value}, head)


def _variants(suite: Suite):
    """(explicit variant, grid overrides, swept values, display name) of every variant, in file order."""
    keys = list(suite.grid)
    combos = list(itertools.product(*(suite.grid[k] for k in keys))) if keys else [()]
    for var in suite.variants or [{}]:
        for combo in combos:
            grid_over = dict(zip(keys, combo))
            values: dict[str, Any] = {}
            parts = []
            if var:
                values["variant"] = var["name"]
                parts.append(str(var["name"]))
            for k, v in grid_over.items():
                values[_short(k)] = v
                parts.append(f"{_short(k)}={format_value(v)}")
            yield var, grid_over, values, ",".join(parts) or "base"


def variant_names(suite: Suite) -> list[str]:
    """The display names of the suite's variants (explicit variants x grid product), in file order."""
    return [name for *_, name in _variants(suite)]


def expand(suite: Suite) -> list[RunSpec]:
    """Every (variant, seed) of the suite: explicit variants x grid product, in file order."""
    runs = []
    for var, grid_over, values, name in _variants(suite):
        # deep copies: a dotted override into a nested mapping (model.moe.score) must not reach other variants
        sections = copy.deepcopy({"model": suite.model, "task": suite.task, "train": suite.train})
        _apply_variant(sections, var)
        _apply_variant(sections, grid_over)
        for seed in suite.seeds:
            runs.append(RunSpec(suite.name, name, values, seed, sections["model"], sections["task"],
                                sections["train"], var.get("family", suite.family)))
    return runs
