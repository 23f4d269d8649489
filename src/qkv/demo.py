"""`qkv demo`: the main job. On a fresh CPU machine, with no data and no flags, it trains
  1. the original Transformer (tiny encoder-decoder) to reverse digit strings of length 10..20, and
  2. a character-level GPT on Python's bundled documentation text,
then prints held-out accuracy / validation loss, sample outputs, and where checkpoints, metrics and
plots went. Both runs are ordinary `qkv train` runs of the shipped configs (configs/reverse.yaml,
configs/charlm.yaml), so every number it prints can be reproduced with one command.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from qkv.experiments import attention_from_checkpoint
from qkv.run import load_run_config, model_folder, train_run

QUICK = ["train.max_steps=20", "eval.n=20", "train.log_every=5"]


def _fresh(folder: Path) -> None:
    """Keep one previous demo run as <name>.prev instead of refusing to overwrite it."""
    if folder.exists():
        prev = folder.with_name(folder.name + ".prev")
        shutil.rmtree(prev, ignore_errors=True)
        folder.rename(prev)


def run_demo(out: Path, quick: bool = False) -> dict[str, dict]:
    results = {}
    t_all = time.perf_counter()
    for i, (name, title) in enumerate([
        ("reverse", "encoder-decoder learns to reverse digit strings (length 10..20)"),
        ("charlm", "character-level GPT on Python's bundled documentation"),
    ], start=1):
        print(f"\n=== [{i}/2] {title} ===", flush=True)
        folder = out / name
        _fresh(folder)
        t0 = time.perf_counter()
        cfg = load_run_config(name, QUICK if quick else [])
        summary = train_run(cfg, out=folder)
        print(summary["report"])
        print(f"({time.perf_counter() - t0:.0f} s)")
        results[name] = summary
    try:  # the reverse model's cross-attention should be an anti-diagonal: show it
        res = attention_from_checkpoint(model_folder(out / "reverse"), "0123456789",
                                        out / "reverse" / "attention.png")
        print("\nattention maps of the reverse model for '0123456789' (cross-attention should be an "
              "anti-diagonal):")
        print("\n".join(f"wrote {p}" for p in res.pngs))
    except Exception as e:  # a plot must never fail the demo
        print(f"(attention maps skipped: {e})")
    print(f"\ndemo finished in {time.perf_counter() - t_all:.0f} s. Next:")
    print(f"  qkv generate {out / 'charlm'} --prompt 'The ' --max-new-tokens 200")
    print(f"  qkv generate {out / 'reverse'} --prompt 31415926535 --greedy")
    print(f"  qkv eval {out / 'reverse'} -n 1000")
    return results
