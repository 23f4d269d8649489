"""A run = a model, a task and training settings, from one YAML file plus dotted overrides.

    model: {preset: transformer-tiny, n_heads: 8}     # a preset (or family: ...) + config overrides
    task:  {name: reverse, min_len: 10, max_len: 20}  # a task name + its options
    train: {max_steps: 600, lr: 1e-3, ...}            # qkv.train.TrainConfig fields
    eval:  {n: 1000, samples: 5}                      # final held-out evaluation

The CLI (`qkv train/eval/generate/info`), the demo and the ablation runner (qkv.experiments) are thin
layers over these functions: `train_run` is the one way to build and train a run.
A run folder holds run.yaml, task.json + tokenizer, metrics.jsonl/csv, curves.png, checkpoints/ and
results.json; `load_model_any` and `load_run_task` rebuild the model and the task from it alone.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml

import qkv
from qkv.config import (
    ConfigError,
    apply_overrides,
    check_fields,
    from_dict,
    load_yaml,
    parse_overrides,
    setting,
    suggest,
)
from qkv.folder_sizes import check_new_model_memory
from qkv.models.registry import config_for
from qkv.nn.params import count_parameters

# re-exported: `qkv.run` is where callers (cli, serve, explore, chat) find a folder's model, task and
# tokenizer
from qkv.run.folders import (  # noqa: F401
    check_out_folder,
    load_model_any,
    load_run_task,
    model_folder,
    run_folder_of,
)
from qkv.run.generation import (  # noqa: F401
    folder_tokenizer,
    generate_text,
    hf_folder_tokenizer,
    hugging_face_tokenizer_files,
    load_assistant,
)
from qkv.storage import atomic_write_text
from qkv.tasks import build_task, load_tokenizer, task_names
from qkv.tasks.base import check_recorded_data, recorded_data_sha256
from qkv.tasks.tokenizers import TokenizerError
from qkv.train import NonFiniteError, TrainConfig, Trainer, latest_checkpoint
from qkv.train.checkpoint import STATE_NAME, check_fits, check_same_architecture, read_train_state
from qkv.train.rng import seed_everything

SECTIONS = ("model", "task", "train", "eval")
RUN_FILE = "run.yaml"
RESULTS_FILE = "results.json"


@dataclass
class EvalSettings:
    n: int = setting(500, "held-out examples in the final evaluation", ge=0, note="0 = none")
    samples: int = setting(3, "sample outputs printed at the end", ge=0)
    during_training: int = setting(0, "held-out examples evaluated every train.eval_every steps", ge=0,
                                   note="0 = the final evaluation only")

    def validate(self) -> None:
        check_fields(self, "eval")


def config_path(name_or_path: str) -> Path:
    """A YAML path, or the name of a shipped config (`reverse` -> qkv/configs/reverse.yaml, package data)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    if p.suffix in (".yaml", ".yml") and (p.parent != Path(".") or os.sep in name_or_path):
        raise ConfigError(f"config file not found: {p}")
    shipped = resources.files("qkv") / "configs"
    for cand in (f"{name_or_path}", f"{name_or_path}.yaml"):
        f = shipped / cand
        if f.is_file():
            return Path(str(f))
    names = (
        sorted(x.name[:-5] for x in shipped.iterdir() if x.name.endswith(".yaml")) if shipped.is_dir() else []
    )

    if name_or_path in task_names():  # `qkv train bpelm`: a task without a shipped config of its own
        raise ConfigError(f"config file not found: {name_or_path}; {name_or_path!r} is a task: pass "
                          f"--task {name_or_path} --model PRESET (see `qkv presets`)")
    hint = suggest(name_or_path, names, "shipped configs") if names else ""
    raise ConfigError(f"config file not found: {name_or_path}{hint}")


def load_run_config(path: str | None, overrides: list[str] | None = None) -> dict[str, Any]:
    """Read a run YAML (or start empty) and apply `section.key=value` overrides; sections are checked."""
    data = load_yaml(config_path(path)) if path else {}
    data = apply_overrides(data, parse_overrides(overrides or []), "run config")
    check_sections(data)
    return data


def check_sections(data: Any) -> None:
    """A run config is a mapping of known sections, each a mapping: the CLI's YAML and train_run's dict alike
    (a misspelt section would otherwise be ignored, and a section given as a string fail far from its
    cause)."""
    if not isinstance(data, dict):
        raise ConfigError(f"a run config must be a mapping of sections, got {type(data).__name__}")
    for key in data:
        if key not in SECTIONS:
            raise ConfigError(f"unknown section {key!r} in run config{suggest(str(key), list(SECTIONS))}")
        if not isinstance(data[key], dict):
            raise ConfigError(f"run config section {key!r} must be a mapping, got {data[key]!r}"[:200])


def default_out(cfg: dict[str, Any]) -> Path:
    """train.out_dir when the config names one (the shipped YAMLs do), else runs/<task>-<preset>."""
    if (cfg.get("train") or {}).get("out_dir"):
        return Path(cfg["train"]["out_dir"])
    m = cfg.get("model") or {}
    return (
        Path("runs")
        / f"{(cfg.get('task') or {}).get('name', 'task')}-{m.get('preset', m.get('family', 'model'))}"
    )


def wants_resume(cfg: dict[str, Any], resume: bool = False) -> bool:
    """Whether a run continues its out folder: the --resume flag (`resume`) or train.resume in the config,
    which is the same setting, as train.max_steps is --max-steps's (a value that is not true/false is an
    error here, before anything is read)."""
    value = (cfg.get("train") or {}).get("resume", False)
    if not isinstance(value, bool):
        raise ConfigError(f"train.resume must be true or false, got {value!r}")
    return resume or value


def command_line_config(config: str | None, overrides: list[str], out: str | Path | None,
                        resume: bool) -> tuple[dict[str, Any], Path, bool]:
    """(run config, out folder, resume) for `qkv train CONFIG overrides... [--out OUT] [--resume]`; resume is
    --resume or the config's train.resume (wants_resume).

    A fresh run: the YAML plus the overrides. A resume of a folder holding run.yaml: only what the command
    line names (the overrides, plus the YAML's task and model names, so that resuming with another task
    or model is an error rather than a silent switch); train_run lays them over the saved run, so the
    shipped YAML cannot put back settings the saved run changed (lr, batch size, warmup, ...)."""
    full = load_run_config(config, overrides)
    folder = Path(out) if out else default_out(full)
    resume = wants_resume(full, resume)
    if not (resume and (folder / RUN_FILE).is_file()):
        return full, folder, resume
    named = load_run_config(None, overrides)
    if config:
        ident = load_run_config(config)
        for section, key in (("task", "name"), ("model", "preset"), ("model", "family")):
            if key in (ident.get(section) or {}):
                named.setdefault(section, {}).setdefault(key, ident[section][key])
    return named, folder, resume


@dataclass
class Run:
    """A run, built and checked, nothing written yet (see build_run)."""

    cfg: dict[str, Any]  # the resolved sections, as run.yaml will hold them
    out: Path
    task: Any
    model: torch.nn.Module
    train: Any  # qkv.train.TrainConfig
    eval: EvalSettings
    extra_tasks: dict[str, tuple[Any, int]] = field(default_factory=dict)  # name -> (task, examples)
    resume_from: Path | None = None  # the checkpoint a resume continues (checked to fit the model)

    def eval_fn(self):
        n = self.eval.during_training
        return (lambda m: self.task.evaluate(m, n=n)) if n else None

    def write(self) -> None:
        """run.yaml, task.json and the tokenizer: what `qkv eval/generate` read back."""
        self.out.mkdir(parents=True, exist_ok=True)
        _write_yaml(self.cfg, self.out / RUN_FILE)
        self.task.save(self.out)


def _merge_saved(saved: dict[str, Any], cfg: dict[str, Any], out: Path) -> dict[str, Any]:
    """The saved run with `cfg`'s values laid over it; switching task or model is refused."""
    for section, key in (("task", "name"), ("model", "preset"), ("model", "family")):
        new, old = (cfg.get(section) or {}).get(key), (saved.get(section) or {}).get(key)
        if new is not None and old is not None and new != old:
            raise ConfigError(
                f"{out} holds a run with {section}.{key}={old!r}; --resume continues it and cannot "
                f"switch to {new!r} (choose another --out for a new run)"
            )
    merged = {s: dict(v) for s, v in saved.items() if isinstance(v, dict)}
    for section, values in cfg.items():  # the caller's values win (e.g. more steps)
        merged.setdefault(section, {}).update(values)
    return merged


def build_run(cfg: dict[str, Any], out: str | Path | None = None, *, resume: bool = False,
              extra_evals: dict[str, dict[str, Any]] | None = None) -> Run:
    """Validate and build everything a run needs, writing nothing: the out folder, the sections, the seeded
    task and model, and, for a resume, that the newest checkpoint fits the model built (so a resume with
    the wrong task, vocabulary or shape fails before run.yaml or the tokenizer are touched).

    resume: continue OUT's saved run (run.yaml, its tokenizer, its newest checkpoint), with `cfg`'s values
      laid over the saved ones. extra_evals: {name: {"task": {option: value}, "n": examples}}: more held-out
      sets for the same model (same tokenizer, other task options; the model's context covers them all)."""
    check_sections(cfg)
    out = Path(out) if out else default_out(cfg)
    resume = wants_resume(cfg, resume)  # train.resume: true is --resume
    check_out_folder(out)
    newest = latest_checkpoint(out / "checkpoints")
    if newest is not None and not resume:
        raise ConfigError(
            f"{out} already holds a trained run; pass --resume to continue it or choose another --out"
        )
    tokenizer = None
    if resume and (out / RUN_FILE).is_file():
        cfg = _merge_saved(load_yaml(out / RUN_FILE), cfg, out)
        try:
            tokenizer = load_tokenizer(out)  # the vocabulary the checkpoint was trained with, exactly
        except TokenizerError:
            tokenizer = None  # image tasks have none
    task, model, train_cfg, ev, extra = build_parts(cfg, out, tokenizer, extra_evals or {})
    if resume:
        check_recorded_data(task, recorded_data_sha256(out))
    if resume and getattr(task, "missing", None):  # its text file is gone or changed: nothing to train on
        raise ConfigError(task.missing)
    if resume and newest is not None:
        check_fits(model, newest)
        check_same_architecture(model, newest)
        # readable before run.yaml is rewritten (mapped, not read)
        read_train_state(newest / STATE_NAME, mmap=True)
    # run.yaml describes the run, not how this command started it: a copy of it given to a new run must not
    # make that run continue this folder (as --resume, which is not recorded either)
    train = {k: v for k, v in (cfg.get("train") or {}).items() if k != "resume"}
    cfg = {**cfg, "train": {**train, "out_dir": str(out)}}
    # absolute, as in task.json: a resume from elsewhere
    if getattr(getattr(task, "options", None), "path", None):
        cfg["task"] = {**cfg["task"], "path": task.options.path}
    return Run(cfg, out, task, model, train_cfg, ev, extra, newest if resume else None)


def _context_keys(overrides: dict[str, Any]) -> list[str]:
    return [k for k in overrides if "context" in k or k.endswith("max_len")]


def build_parts(cfg: dict[str, Any], out_dir: Path | None = None, tokenizer: Any = None,
                extra_evals: dict[str, dict[str, Any]] | None = None):
    """(task, model, TrainConfig, EvalSettings, extra tasks) of a run config, seeded with train.seed before
    the task and the model are built. No out-folder checks (build_run does those); `tokenizer`: reuse a
    saved vocabulary; extra_evals as in build_run."""
    model_sec = dict(cfg.get("model") or {})
    task_sec = dict(cfg.get("task") or {})
    if "preset" not in model_sec and "family" not in model_sec:
        raise ConfigError("no model given: pass --model PRESET (see `qkv presets`) or model.preset=...")
    if "name" not in task_sec:
        raise ConfigError("no task given: pass --task NAME or task.name=...")
    train = dict(cfg.get("train") or {})
    if out_dir is not None:
        train["out_dir"] = str(out_dir)
    train_cfg = from_dict(TrainConfig, train, "train")
    ev = from_dict(EvalSettings, dict(cfg.get("eval") or {}), "eval")
    base = {k: v for k, v in model_sec.items() if k in ("preset", "family")}
    fields = {k: v for k, v in model_sec.items() if k not in ("preset", "family")}
    fam, _ = config_for(base)
    # seed before anything random is drawn: the model's initial weights (and any randomness in building the
    # task) depend on train.seed alone, so one seed gives the same run in a new process
    seed_everything(train_cfg.seed)
    name = task_sec.pop("name")
    task = build_task(name, family=fam.name, saved_tokenizer=tokenizer, **task_sec)
    extra, context = {}, {}
    for ev_name, spec in (extra_evals or {}).items():
        t = build_task(
            name, family=fam.name, saved_tokenizer=task.tokenizer, **{**task_sec, **spec.get("task", {})}
        )
        extra[ev_name] = (t, int(spec.get("n") or ev.n or 1))
        # the model must accept the longest evaluation sequences too (length extrapolation)
        own = task.config_overrides()  # in the family's config fields
        for k, v in t.config_overrides().items():
            if k in _context_keys(own) and isinstance(v, int):
                context[k] = max(context.get(k, own[k]), v)
    needs = task.config_overrides()  # the sizes the task's data needs: a smaller one would fail mid-run
    for k, v in fields.items():
        sized = "vocab" in k or k in _context_keys(needs)
        if sized and isinstance(needs.get(k), int) and isinstance(v, int) and v < needs[k]:
            raise ConfigError(f"model.{k}={v} is below what the task {name!r} needs ({needs[k]})")
    build = functools.partial(task.build_model, base, **{**context, **fields})
    check_new_model_memory(build, fields, "the model config")
    return task, build(), train_cfg, ev, extra


def _write_yaml(obj: Any, path: Path) -> None:
    atomic_write_text(yaml.safe_dump(obj, sort_keys=False), path)


class TrainRecipe:
    """`qkv train`'s run in phases, as a fine-tuning recipe runs: built from a checked Run (build_run: nothing
    written yet), then

        setup()     -> Trainer    the training settings checked against the model; run.yaml, task.json and
                                  the tokenizer written (rank 0)
        train()     -> summary    Trainer.fit (a NaN stop kept as `error` when keep_going)
        evaluate()  -> metrics    the held-out split, the extra evaluations and samples (rank 0)
        save()      -> result     results.json
        report()    -> str        what `qkv train` prints

    run() goes through them and returns the summary every caller reads (`qkv train`, `qkv demo`, the
    ablation runner, `qkv speedrun`); on ranks other than 0 under torchrun, train() is the last phase."""

    def __init__(self, run: Run, *, callbacks: list | tuple = (), keep_going: bool = False,
                 quiet: bool = False) -> None:
        self.built = run
        self.callbacks, self.keep_going, self.quiet = list(callbacks), keep_going, quiet
        self.trainer: Trainer | None = None
        self.error: str | None = None
        self.model: torch.nn.Module | None = None  # the trained model rank 0 evaluates (None: none finite)

    def setup(self) -> Trainer:
        run = self.built
        # the Trainer checks the training settings against the model
        self.trainer = Trainer(run.model, run.train, run.task, eval_fn=run.eval_fn(),
                               callbacks=self.callbacks, resume=run.resume_from is not None)
        if self.trainer.dist.is_main:
            run.write()
            if run.resume_from is not None and not self.quiet:
                print(f"resuming {run.out} from {run.resume_from.name}: the saved run's settings (run.yaml) "
                      "apply; the command line overrides only what it names", file=sys.stderr)
        return self.trainer

    def train(self) -> dict[str, Any]:
        trainer = self.trainer
        t0 = time.perf_counter()
        try:
            return trainer.fit()
        except NonFiniteError as e:
            if not self.keep_going:
                trainer.close()
                raise
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0]}"[:300]
            return trainer.summary(time.perf_counter() - t0)

    def evaluate(self) -> tuple[dict[str, Any], dict[str, dict[str, Any]], list[str]]:
        """(held-out metrics, extra evaluations, samples) of the trained model, rank 0 only."""
        trainer, run, ev = self.trainer, self.built, self.built.eval
        model = trainer.model
        if trainer.dist.mode == "fsdp":  # the sharded module's forward needs every rank: evaluate a full copy
            model = qkv.from_pretrained(trainer.last_checkpoint) if trainer.last_checkpoint else None
        trainer.close()
        self.model = model
        if model is None or not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            return {}, {}, []
        model.eval()
        last = dict(trainer.last_eval)
        metrics: dict[str, Any] = {}
        if ev.n and last.get("_step") == trainer.step and ev.during_training == ev.n and self.error is None:
            metrics = {k: v for k, v in last.items() if not k.startswith("_")}  # fit() just evaluated it
        elif ev.n:
            metrics = run.task.evaluate(model, n=ev.n)
        extra = {name: t.evaluate(model, n=n) for name, (t, n) in run.extra_tasks.items()}
        return metrics, extra, run.task.samples(model, ev.samples) if ev.samples else []

    def save(self, summary: dict[str, Any], metrics: dict[str, Any], extra: dict[str, dict[str, Any]],
             samples: list[str]) -> dict[str, Any]:
        """results.json, and the result it holds."""
        result = {"metrics": metrics, "extra": extra, "samples": samples, "train": _jsonable(summary),
                  "error": self.error,
                  "parameters": count_parameters(self.model) if self.model is not None else None}
        atomic_write_text(json.dumps(result, indent=2, default=str) + "\n", self.built.out / RESULTS_FILE)
        return result

    def report(self, metrics: dict[str, Any], samples: list[str]) -> str:
        out = self.built.out
        lines = [f"run folder: {out}"]
        if metrics:
            lines.append(f"held-out ({_measured(metrics, self.built.eval.n)}): " + ", ".join(
                f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
                if k not in ("n", "n_tokens")))
        if samples:
            lines += ["samples:"] + [f"  {s}" for s in samples]
        lines += [f"checkpoint: {self.trainer.last_checkpoint}", f"metrics: {out / 'metrics.jsonl'}",
                  f"plot: {out / 'curves.png'}"]
        return "\n".join(lines)

    def run(self) -> dict[str, Any]:
        out, task = self.built.out, self.built.task
        self.setup()
        summary = self.train()
        if not self.trainer.dist.is_main:  # under torchrun only rank 0 evaluates and writes results
            self.trainer.close()
            return {"out": out, "metrics": {}, "extra": {}, "samples": [], "train": summary, "report": "",
                    "error": self.error, "model": self.trainer.model, "task": task}
        metrics, extra, samples = self.evaluate()
        self.save(summary, metrics, extra, samples)
        return {"out": out, "metrics": metrics, "extra": extra, "samples": samples, "train": summary,
                "report": self.report(metrics, samples), "error": self.error, "model": self.model,
                "task": task}


def train_run(
    cfg: dict[str, Any],
    out: str | Path | None = None,
    resume: bool = False,
    quiet: bool = False,
    *,
    callbacks: list | tuple = (),
    extra_evals: dict[str, dict[str, Any]] | None = None,
    keep_going: bool = False,
) -> dict[str, Any]:
    """Train, evaluate on the held-out split, write results.json; returns a summary with a printable report.

    The one way to build and train a run: `qkv train`, `qkv demo` and the ablation runner all come here,
    so seeding, resume and validation live in one place. Everything is checked before anything is written.
    callbacks: extra Trainer callbacks. keep_going: a run the NaN guard stops is evaluated and returned with
    its "error" instead of raising (the ablation runner records divergence as a result)."""
    run = build_run(cfg, out, resume=resume, extra_evals=extra_evals)
    return TrainRecipe(run, callbacks=callbacks, keep_going=keep_going, quiet=quiet).run()


def _measured(metrics: dict[str, Any], asked: int) -> str:
    """What an evaluation actually scored, from its own counts (not the eval.n that was asked for)."""
    if "n" in metrics:
        return f"{int(metrics['n']):,} examples"
    if "n_tokens" in metrics:
        return f"{int(metrics['n_tokens']):,} scored tokens"
    return f"up to {asked:,} examples"


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def evaluate_run(path: str | Path, n: int = 500) -> dict[str, Any]:
    if n < 1:
        raise ConfigError(f"n must be at least 1 (held-out examples to evaluate), got {n}")
    model, task = load_model_any(path), load_run_task(path)
    model.eval()
    return task.evaluate(model, n=n)


__all__ = ["EvalSettings", "Run", "TrainRecipe", "build_parts", "build_run", "command_line_config",
           "wants_resume", "evaluate_run", "generate_text", "hf_folder_tokenizer", "load_assistant",
           "hugging_face_tokenizer_files", "load_model_any", "load_run_config", "load_run_task",
           "model_folder", "train_run"]
