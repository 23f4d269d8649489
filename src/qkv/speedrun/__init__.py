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

Under `torchrun --nproc_per_node=N qkv speedrun ...` every rank trains (pretrain and sft, data-parallel as
`qkv train` is under torchrun, the same global batch), while the phases that write one file each (data,
tokenizer, evaluate, report) run on rank 0 alone and the other ranks wait for its record of them.
"""

from __future__ import annotations

import os
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
from qkv.speedrun.state import PHASES, open_state, read_state, record_phase
from qkv.train.distributed import end_group, launched_by_torchrun, start_group

# The phases every rank runs under torchrun (their training is data-parallel); rank 0 alone runs the rest.
ALL_RANKS = ("pretrain", "sft")
# How often a waiting rank rereads DIR/speedrun.json for rank 0's record of a phase.
POLL_S = 0.5


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
    rank = int(os.environ["RANK"]) if launched_by_torchrun() else 0
    say = log or (lambda line: print(line, file=sys.stderr))
    if rank != 0:  # rank 0 tells the story once
        say = _silent
    p = load_profile(profile, overrides)
    out = Path(out)
    start_group()  # under torchrun: one process group for both trainings
    try:
        return _phases(out, p, rank, quiet, say)
    finally:
        end_group()


def _phases(out: Path, p: Profile, rank: int, quiet: bool, say: Callable[[str], None]) -> dict[str, Any]:
    """Every phase not yet recorded in OUT, in order (rank 0 alone runs those outside ALL_RANKS)."""
    # rank 0 checks OUT and writes the record first; the others read it once it is there
    state = open_state(out, p.to_dict()) if rank == 0 else _wait_for(out, lambda s: True)
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
        if rank != 0 and phase not in ALL_RANKS:
            state = _wait_for(out, lambda s, phase=phase: phase in s["phases"])
            continue
        say(f"speedrun: {phase} ...")
        figures = _timed(phase, steps[phase])
        if rank == 0:
            record_phase(out, state, phase, figures)
        say(f"speedrun: {phase} done in {figures['wall_s']:.0f} s")
    if skipped:
        say(f"speedrun: {', '.join(skipped)} already complete in {out} (skipped)")
    return {"out": out, "state": state, "report": out / "report.md", "skipped": skipped}


def _silent(line: str) -> None:
    del line


def _wait_for(out: Path, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """A rank other than 0: OUT's record once `done` holds of it. No timeout of its own: when rank 0 fails,
    torchrun stops every rank."""
    while True:
        state = read_state(out)
        if state is not None and done(state):
            return state
        time.sleep(POLL_S)


def _total_wall(state: dict[str, Any]) -> float:
    return sum(f.get("wall_s", 0.0) for f in state["phases"].values())


__all__ = ["DEFAULT_PROFILE", "PHASES", "Profile", "load_profile", "profile_names", "speedrun"]
