"""A/B of two source trees on the serve load's engine part (issue 13): Engine.run() over benchmarks/serve.py's
64 requests (prompts 16..512, outputs 16..256, same generator), 'gpt-bench' with a 1024-position table,
random weights (seed 0), fp32, CPU. Each run is its own process (a source tree cannot be swapped inside one
interpreter), alternating A B A B ..., so load from other processes on a shared machine hits both alike;
medians and the ratio of medians are reported (wall and process CPU time: on a shared machine the CPU time
is the steadier of the two), with the generated tokens of both trees compared.

    python docs/perf/srv13c/ab_engine.py --a OLD/src --b NEW/src [--rounds 3] [--clients 64]
(OLD/src: e.g. `git archive main src | tar -x -C /tmp/old`.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import hashlib, json, sys, time, torch
import qkv
from qkv.generate import Engine
n, pmax, nmax = map(int, sys.argv[1:4])
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
rnd = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))
prompts = [torch.randint(0, 65, (rnd(16, pmax),), generator=g).tolist() for _ in range(n)]
news = [rnd(16, nmax) for _ in range(n)]
torch.manual_seed(0)
m = qkv.build("gpt-bench", context_length=1024, position="learned").eval()
e = Engine(m, max_batch_size=n)
w = e.add_request(prompts[0][:16], 4); e.run()  # first-call costs, untimed
e = Engine(m, max_batch_size=n)
rids = [e.add_request(p, k) for p, k in zip(prompts, news)]
t0, c0 = time.perf_counter(), time.process_time()
out = e.run()
dt, cpu = time.perf_counter() - t0, time.process_time() - c0
h = hashlib.sha256(json.dumps([out[r] for r in rids]).encode()).hexdigest()[:16]
print(json.dumps({"s": dt, "cpu_s": cpu, "tokens": sum(news), "steps": e.steps, "hash": h}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="src folder of tree A (the base)")
    ap.add_argument("--b", required=True, help="src folder of tree B (the change)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--new-max", type=int, default=256)
    ap.add_argument("--out", default=None, help="JSON path (+ .md beside it)")
    a = ap.parse_args()
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for i in range(a.rounds):
        for name, src in (("A", a.a), ("B", a.b)) if i % 2 == 0 else (("B", a.b), ("A", a.a)):
            env = {**os.environ, "PYTHONPATH": os.path.abspath(src), "OMP_WAIT_POLICY": "PASSIVE"}
            r = subprocess.run([sys.executable, "-c", CHILD, str(a.clients), str(a.prompt_max), str(a.new_max)],
                               env=env, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(name, runs[name][-1], flush=True)
    med = {k: statistics.median(x["s"] for x in v) for k, v in runs.items()}
    cpu = {k: statistics.median(x["cpu_s"] for x in v) for k, v in runs.items()}
    tok = runs["A"][0]["tokens"]
    same = len({x["hash"] for v in runs.values() for x in v}) == 1
    res = {"A": a.a, "B": a.b, "rounds": a.rounds, "clients": a.clients, "tokens": tok,
           "A_tok_s": round(tok / med["A"], 1), "B_tok_s": round(tok / med["B"], 1),
           "B_over_A": round(med["A"] / med["B"], 3), "A_cpu_s": round(cpu["A"], 2), "B_cpu_s": round(cpu["B"], 2),
           "B_over_A_cpu": round(cpu["A"] / cpu["B"], 3), "runs": runs, "same_tokens": same,
           "threads_env": os.environ.get("OMP_NUM_THREADS")}
    line = (f"engine on the serve load ({a.clients} requests, {tok} tokens): A {res['A_tok_s']} tok/s, "
            f"B {res['B_tok_s']} tok/s, B/A {res['B_over_A']}x wall, {res['B_over_A_cpu']}x CPU time "
            f"({res['A_cpu_s']} vs {res['B_cpu_s']} s; medians of {a.rounds} alternating runs); "
            f"same tokens: {same}")
    print(line)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
        with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
