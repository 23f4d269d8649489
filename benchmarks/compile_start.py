"""What compiling costs a user at start: a fresh process that loads a folder and generates with compile=True
(what `qkv generate/chat --compile` do), twice over one empty cache folder (QKV_CACHE), against the same
process without compiling.

  cold   the first compiled run: Dynamo traces the decoding step, Inductor generates and builds its code
  warm   a second process: it traces again but finds Inductor's code under $QKV_CACHE/inductor
  eager  no compile at all

Each is the wall time of the whole process (import, load, prefill, --new greedy tokens). Model:
benchmarks/llm.py's 135M Llama shape with random weights (--quick: 2 layers of width 64).

    .venv/bin/python benchmarks/compile_start.py [--quick] [--new 64] [--threads 2]

Writes OUT/compile_start.json and .md (OUT = benchmarks/results).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from _timing import write_results  # noqa: E402
from llm import FULL, QUICK  # noqa: E402


def build_folder(spec: dict, path: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**spec, bos_token_id=1, eos_token_id=None)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


def timed_run(folder: Path, cache: Path, new: int, threads: int, compile: bool) -> float:
    """Seconds of one process that loads the folder and generates `new` greedy tokens after a 32-token
    prompt."""
    code = ("import sys, torch; from qkv import from_pretrained; from qkv.generate import generate; "
            f"torch.set_num_threads({threads}); m = from_pretrained(sys.argv[1]); "
            f"generate(m, torch.arange(3, 35).view(1, -1), max_new_tokens={new}, min_new_tokens={new}, "
            f"compile={compile})")
    env = {**os.environ, "QKV_CACHE": str(cache), "PYTHONPATH": str(ROOT.parent / "src")}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True, env=env, timeout=3600)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="qkv-compile-start-") as tmp:
        folder, cache = Path(tmp) / "model", Path(tmp) / "cache"
        build_folder(QUICK if a.quick else FULL, folder)
        eager = timed_run(folder, cache, a.new, a.threads, False)
        cold = timed_run(folder, cache, a.new, a.threads, True)
        warm = timed_run(folder, cache, a.new, a.threads, True)
        kept = sum(f.stat().st_size for f in (cache / "inductor").rglob("*") if f.is_file())
    result = {"quick": a.quick, "new_tokens": a.new, "threads": a.threads, "eager_s": round(eager, 1),
              "compiled_cold_s": round(cold, 1), "compiled_warm_s": round(warm, 1),
              "cache_mb": round(kept / 1e6, 1)}
    lines = [f"`qkv`-style generate of {a.new} tokens in a fresh process ({a.threads} threads)", "",
             "| run | wall s |", "|---|---|",
             f"| eager | {eager:.1f} |", f"| --compile, first process (empty cache) | {cold:.1f} |",
             f"| --compile, second process (cache kept: {kept / 1e6:.0f} MB) | {warm:.1f} |"]
    write_results(a.out, "compile_start_quick" if a.quick else "compile_start", result, lines)


if __name__ == "__main__":
    main()
