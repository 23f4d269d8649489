"""Repetition in long generations (000 §6.1): distinct-n over 1,000 generated tokens of a small trained LM,
with and without repetition_penalty / no_repeat_ngram_size.

A qkv language-model run (`--run`, e.g. `qkv train charlm --out runs/charlm`; without it the script trains one
with configs/charlm.yaml for `--train-steps` steps into a temporary folder) continues each of `--prompts` for
`--tokens` tokens, the context sliding (context_overflow="slide": gpt-tiny sees its last 64 tokens), under
each setting: greedy, greedy with a repetition penalty, greedy with no_repeat_ngram_size, sampling at
temperature 0.8, and sampling with the penalty (sampling: `--seeds` seeds per prompt). distinct-n = distinct
n-grams / n-grams of the generated tokens (1.0: no n-gram repeats; a loop drives it towards 0), averaged over
prompts and seeds; "in a loop" = the share of generated tokens inside a 32-gram that already occurred earlier
in the same continuation. For a character model n counts characters, so n is 4..16 and the n-gram ban is
long (a ban of 3 characters would forbid repeating "the"). Deterministic given the run: no timing.

    .venv/bin/python benchmarks/repetition.py --run runs/charlm [--tokens 1000] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))
sys.path.insert(0, str(ROOT))

from _timing import write_results  # noqa: E402
from qkv.generate import generate  # noqa: E402
from qkv.run import command_line_config, train_run  # noqa: E402
from qkv.run.folders import load_model_any, load_run_task  # noqa: E402

PROMPTS = ["The ", "In Python, ", "A list is "]
NS = (4, 8, 16)
LOOP = 32
SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": {"do_sample": False},
    "greedy, repetition_penalty 1.3": {"do_sample": False, "repetition_penalty": 1.3},
    "greedy, no_repeat_ngram_size 12": {"do_sample": False, "no_repeat_ngram_size": 12},
    "sample T=0.8": {"do_sample": True, "temperature": 0.8},
    "sample T=0.8, repetition_penalty 1.3": {"do_sample": True, "temperature": 0.8,
                                             "repetition_penalty": 1.3},
}


def distinct(tokens: list[int], n: int) -> float:
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def loop_share(tokens: list[int], n: int = LOOP) -> float:
    """Share of tokens covered by an n-gram that occurred before in the same sequence."""
    seen: set[tuple[int, ...]] = set()
    covered = [False] * len(tokens)
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        if gram in seen:
            covered[i:i + n] = [True] * n
        seen.add(gram)
    return sum(covered) / len(tokens) if tokens else 0.0


def trained_run(steps: int, folder: Path) -> Path:
    cfg, out, resume = command_line_config("charlm", [f"train.max_steps={steps}", "train.progress=false",
                                                      "eval.n=8"], str(folder), False)
    train_run(cfg, out=out, resume=resume)
    return Path(out)


def continuations(run: Path, tokens: int, seeds: int, prompts: list[str]) -> dict[str, list[list[int]]]:
    model, task = load_model_any(run).eval(), load_run_task(run)
    out: dict[str, list[list[int]]] = {}
    for name, setting in SETTINGS.items():
        out[name] = []
        for prompt in prompts:
            ids = torch.tensor([task.tokenizer.encode(prompt)])
            for seed in range(seeds if setting["do_sample"] else 1):
                g = torch.Generator().manual_seed(seed)
                # no eos: a char LM's continuation runs the full length
                y = generate(model, ids, max_new_tokens=tokens, context_overflow="slide", generator=g,
                             eos_token_id=None, **setting)
                out[name].append(y[0, ids.shape[1]:].tolist())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default=None, help="a trained LM run folder (default: train one)")
    ap.add_argument("--train-steps", type=int, default=600, help="steps of the run trained without --run")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a 10-step run, 120 tokens, one prompt and seed")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the output does not depend on it)")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.quick:
        a.train_steps, a.tokens, a.seeds = 10, 120, 1
    prompts = PROMPTS[:1] if a.quick else PROMPTS
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(a.run) if a.run else trained_run(a.train_steps, Path(tmp) / "charlm")
        gens = continuations(run, a.tokens, a.seeds, prompts)
        sample = load_run_task(run).tokenizer.decode(gens["greedy"][0][:160])
    rows = []
    for name, seqs in gens.items():
        row = {"setting": name, "continuations": len(seqs), "tokens": len(seqs[0])}
        for n in NS:
            row[f"distinct_{n}"] = round(statistics.mean(distinct(s, n) for s in seqs), 3)
        row["loop_share"] = round(statistics.mean(loop_share(s) for s in seqs), 3)
        rows.append(row)
    head = " | ".join(f"distinct-{n}" for n in NS)
    lines = [f"| setting | continuations x tokens | {head} | in a loop ({LOOP}-gram seen before) |",
             "|---|---|" + "---|" * len(NS) + "---|"]
    for r in rows:
        vals = " | ".join(f"{r[f'distinct_{n}']:.3f}" for n in NS)
        lines.append(f"| {r['setting']} | {r['continuations']} x {r['tokens']} | {vals} | "
                     f"{r['loop_share']:.1%} |")
    lines += ["", f"greedy, first 160 characters: {sample!r}"]
    meta = {"run": a.run, "train_steps": None if a.run else a.train_steps, "prompts": prompts,
            "seeds": a.seeds, "torch": torch.__version__, "machine": platform.processor()}
    write_results(a.out, "repetition_quick" if a.quick else "repetition", {"meta": meta, "rows": rows}, lines)


if __name__ == "__main__":
    main()
