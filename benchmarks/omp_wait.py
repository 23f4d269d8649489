"""OpenMP's wait policy and batch-1 one-row products: libgomp's default (unset) vs PASSIVE vs ACTIVE.

OMP_WAIT_POLICY is read once, when torch's OpenMP runtime loads, so every policy runs in its own process (a
fresh `python -c` child per policy and round, the rounds interleaved: default, PASSIVE, ACTIVE, default, ...).
Each child times F.linear(x, w) with x one row, over distinct fp32 weights of the 135M Llama's shapes (576 x
576 for q and o, 192 x 576 for k and v, 1536 x 576 for gate and up, 576 x 1536 for down; 60 MB or more of
each, so they stream from memory), on --threads threads, best of 7 passes; GB/s = weight bytes / time. Then it
sleeps 2 s and reports the CPU time its threads burned while idle (what a waiting chat or server costs).

    .venv/bin/python benchmarks/omp_wait.py [--threads 2] [--rounds 3] [--quick]

--quick: 6 MB of weights per shape, one round (the smoke test, tests/benchmarks/test_benchmark_omp_wait.py).
Writes OUT/omp_wait.json and .md (OUT = benchmarks/results). The question it answers: which policy should
qkv's commands run under (docs/performance.md)?
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from _timing import write_results

ROOT = Path(__file__).resolve().parent
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]
POLICIES = ("default", "PASSIVE", "ACTIVE")

# the child: per shape, GB/s of one-row products over enough distinct weights to leave the caches; then the
# CPU seconds its threads burn during 2 s of sleep
CHILD = """
import json, resource, sys, time
import torch
import torch.nn.functional as F
torch.set_num_threads(int(sys.argv[1]))
out = {}
for n, k in json.loads(sys.argv[2]):
    ws = [torch.randn(n, k) for _ in range(max(1, int(sys.argv[3]) // (n * k * 4)))]
    x = torch.randn(1, k)
    for w in ws:  # warm-up: the thread pool, the kernel's first call
        F.linear(x, w)
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        for w in ws:
            F.linear(x, w)
        best = min(best, time.perf_counter() - t)
    out[f"{n}x{k}"] = sum(w.numel() * 4 for w in ws) / best / 1e9
r0 = resource.getrusage(resource.RUSAGE_SELF)
time.sleep(2)
r1 = resource.getrusage(resource.RUSAGE_SELF)
out["idle_cpu_s"] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
print(json.dumps(out))
"""


def run_child(policy: str, threads: int, weight_bytes: int) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    args = [sys.executable, "-c", CHILD, str(threads), json.dumps(SHAPES), str(weight_bytes)]
    r = subprocess.run(args, env=env, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args()
    weight_bytes = 6_000_000 if a.quick else 60_000_000
    if a.quick:
        a.rounds = 1
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
    for _ in range(a.rounds):
        for p in POLICIES:
            runs[p].append(run_child(p, a.threads, weight_bytes))
    keys = [f"{n}x{k}" for n, k in SHAPES]
    med = {p: {key: statistics.median(r[key] for r in runs[p]) for key in [*keys, "idle_cpu_s"]}
           for p in POLICIES}
    lines = [f"one-row fp32 products, {a.threads} threads, GB/s (median of {a.rounds} processes per policy, "
             f"each the best of 7 passes); {platform.processor() or platform.machine()}",
             "",
             "| OMP_WAIT_POLICY | " + " | ".join(keys) + " | x default (mean) | idle CPU s in 2 s |",
             "|---|" + "---:|" * (len(keys) + 2)]
    for p in POLICIES:
        ratio = statistics.mean(med[p][k] / med["default"][k] for k in keys)
        lines.append(f"| {p} | " + " | ".join(f"{med[p][k]:.1f}" for k in keys)
                     + f" | {ratio:.2f} | {med[p]['idle_cpu_s']:.3f} |")
    result = {"threads": a.threads, "rounds": a.rounds, "runs": runs, "median": med}
    write_results(a.out, "omp_wait_quick" if a.quick else "omp_wait", result, lines)


if __name__ == "__main__":
    main()
