"""`qkv speedrun`: a chat model of your own from nothing, on your own machine, offline.

    qkv speedrun [--profile quick|cpu|gpu|FILE.yaml] --out DIR [section.key=value ...]

The phases, in order, each writing its part of DIR (qkv.speedrun.phases, evaluate, report):

    data       the Python standard library's modules split into train / held-out (by module), the SFT
               conversations and the evaluation questions                         -> DIR/data
    tokenizer  byte-level BPE on the train modules, chat role markers reserved    -> DIR/tokenizer
    pretrain   a Llama-shaped decoder (`qkv train`, task lm)                      -> DIR/base (a run folder)
    sft        `qkv finetune --task chat` of DIR/base (its chat template written) -> DIR/chat (a model folder)
    evaluate   held-out doc QA, code parse rate, synthetic exact match, samples   -> DIR/eval/results.json
    report     the report card with loss curves                                   -> DIR/report.md

A phase is complete only once DIR/speedrun.json records it (qkv.speedrun.state); rerunning the command skips
completed phases and continues a partial pretrain or fine-tune from its newest checkpoint. DIR/chat is an
ordinary model folder: `qkv chat`, `qkv serve`, `qkv explore` and `qkv export` take it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkv.config import ConfigError
from qkv.speedrun.evaluate import evaluate_phase
from qkv.speedrun.phases import data_phase, pretrain_phase, sft_phase, tokenizer_phase
from qkv.speedrun.profile import DEFAULT_PROFILE, Profile, load_profile, profile_names
from qkv.speedrun.report import write_report
from qkv.speedrun.state import PHASES, open_state, record_phase
from qkv.train.distributed import world_size


def _timed(phase: str, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one phase; its figures with its wall and CPU time. A file system error (a full disk) is one line
    naming the phase, which stays unrecorded."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        figures = work()
    except OSError as e:
        raise ConfigError(f"speedrun phase {phase}: cannot write {e.filename or 'its output'}: "
                          f"{e.strerror or e}; the phase is not marked complete: free space and rerun the "
                          "same command to continue") from None
    return {**figures, "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}


def speedrun(out: str | Path, profile: str | None = None, overrides: list[str] | None = None, *,
             quiet: bool = False, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run (or continue) the speedrun in `out`; returns {"out", "state", "report", "skipped"}."""
    say = log or (lambda line: print(line, file=sys.stderr))
    if world_size() > 1:  # every rank would write the data, tokenizer, evaluation and report at once
        raise ConfigError("qkv speedrun runs as one process (one GPU at most), not under torchrun")
    p = load_profile(profile, overrides)
    out = Path(out)
    state = open_state(out, p.to_dict())
    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "data": lambda: data_phase(out, p),
        "tokenizer": lambda: tokenizer_phase(out, p),
        "pretrain": lambda: pretrain_phase(out, p, quiet,
                                           state["phases"]["tokenizer"]["val_bytes_per_token"]),
        "sft": lambda: sft_phase(out, p, quiet),
        "evaluate": lambda: evaluate_phase(out, p),
        "report": lambda: {"report": str(write_report(out, state, _total_wall(state)))},
    }
    skipped = []
    for phase in PHASES:
        if phase in state["phases"]:
            skipped.append(phase)
            continue
        say(f"speedrun: {phase} ...")
        figures = _timed(phase, steps[phase])
        record_phase(out, state, phase, figures)
        say(f"speedrun: {phase} done in {figures['wall_s']:.0f} s")
    if skipped:
        say(f"speedrun: {', '.join(skipped)} already complete in {out} (skipped)")
    return {"out": out, "state": state, "report": out / "report.md", "skipped": skipped}


def _total_wall(state: dict[str, Any]) -> float:
    return sum(f.get("wall_s", 0.0) for f in state["phases"].values())


__all__ = ["DEFAULT_PROFILE", "PHASES", "Profile", "load_profile", "profile_names", "speedrun"]
