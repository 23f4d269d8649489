"""One run of a suite as `qkv train` sees it: its run config (model / task / train / eval sections), its
extra evaluations, and its built model and tasks. The floor that the runner and the efficiency timings both
stand on."""

from __future__ import annotations

from typing import Any

from qkv.experiments.suite import RunSpec, Suite
from qkv.run import build_parts


def run_config(suite: Suite, spec: RunSpec) -> dict[str, Any]:
    """The run config (model / task / train / eval sections, as `qkv train` reads them) of one run."""
    scored = suite.metric.name != "train_loss"
    train = {"progress": False, "tensorboard": False, "plot": False, "keep_last": 1, **spec.train,
             "seed": spec.seed, "resume": False}
    return {"model": dict(spec.model), "task": dict(spec.task), "train": train,
            "eval": {"n": suite.eval_n if scored else 0, "samples": 0,
                     "during_training": suite.eval_n if scored else 0}}


def extra_evals(suite: Suite) -> dict[str, dict[str, Any]]:
    return {ev.name: {"task": dict(ev.task), "n": ev.n or suite.eval_n} for ev in suite.extra_evals}


def build_run(suite: Suite, spec: RunSpec):
    """(model, train task, extra eval tasks) for one run, seeded: qkv.run.build_parts, as `qkv train` does."""
    task, model, _, _, extra = build_parts(run_config(suite, spec), extra_evals=extra_evals(suite))
    return model, task, {name: t for name, (t, _) in extra.items()}
