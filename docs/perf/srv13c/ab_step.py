"""A/B/C.. of source trees on one decoding step of the paged engine at the serve load (issue 13): 'gpt-bench'
(6 layers, 384 wide, 6 heads, 1024 positions, random weights, seed 0), 64 sequences whose cached lengths are
drawn like benchmarks/serve.py's requests midway (prompt 16..512 + 0..256 generated), their keys/values
written with random values (one update per sequence and layer: no prefill needed to reach the state), then
`model.step` over all 64 rows (one forward, per-row offsets and key mask) for --steps steps. Each tree runs
in its own process, the trees alternating round by round; medians of ms/step (wall and process CPU time).

    python docs/perf/srv13c/ab_step.py NAME=SRC NAME=SRC ... [--rounds 6] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time, torch
import qkv
steps, B = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
m = qkv.build("gpt-bench", context_length=1024, position="learned").eval()
g = torch.Generator().manual_seed(0)
lens = [int(torch.randint(16, 513, (1,), generator=g)) + int(torch.randint(0, 257, (1,), generator=g)) for _ in range(B)]
c = m.config
cache = m.make_paged_cache(sum(-(-(n + steps + 8) // 16) for n in lens) + 8, 16)
hd = c.d_model // c.n_heads
for i, n in enumerate(lens):
    cache.add_sequence(i)
    cache.set_active([i])
    for layer in range(c.n_layers):
        cache.update(layer, torch.randn(1, c.n_heads, n, hd, generator=g), torch.randn(1, c.n_heads, n, hd, generator=g))
    cache.advance(n)
ids = torch.randint(0, 65, (B, 1), generator=g)
times, cpus = [], []
with torch.no_grad():
    for s in range(steps + 3):
        cache.set_active(list(range(B)))
        t0, c0 = time.perf_counter(), time.process_time()
        out = m.step(ids, cache, keep=cache.keep_mask(1))
        if s >= 3:
            times.append(time.perf_counter() - t0); cpus.append(time.process_time() - c0)
        ids = out.argmax(-1, keepdim=True)
print(json.dumps({"ms": 1000 * sorted(times)[len(times) // 2], "cpu_ms": 1000 * sorted(cpus)[len(cpus) // 2],
                  "last": ids.view(-1).tolist()[:8]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="+", help="NAME=path/to/src")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=None, help="JSON path (+ .md beside it)")
    a = ap.parse_args()
    trees = [t.split("=", 1) for t in a.trees]
    runs: dict[str, list[dict]] = {n: [] for n, _ in trees}
    for i in range(a.rounds):
        for name, src in trees if i % 2 == 0 else trees[::-1]:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(src), "OMP_WAIT_POLICY": "PASSIVE"}
            r = subprocess.run([sys.executable, "-c", CHILD, str(a.steps), str(a.batch)], env=env,
                               capture_output=True, text=True, check=True)
            runs[name].append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(name, runs[name][-1], flush=True)
    base = trees[0][0]
    med = {n: (statistics.median(x["ms"] for x in v), statistics.median(x["cpu_ms"] for x in v)) for n, v in runs.items()}
    lines = [f"| tree | ms/step (wall) | ms/step (CPU) | vs {base} (wall) | vs {base} (CPU) |", "|---|---|---|---|---|"]
    for n, (w, c) in med.items():
        lines.append(f"| {n} | {w:.1f} | {c:.1f} | {med[base][0] / w:.2f}x | {med[base][1] / c:.2f}x |")
    same = len({json.dumps(x["last"]) for v in runs.values() for x in v}) == 1
    lines += ["", f"{a.batch} sequences, {a.steps} steps per run, medians of {a.rounds} alternating runs; "
                  f"same greedy tokens in every run: {same}"]
    print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"runs": runs, "trees": dict(trees), "same_tokens": same}, f, indent=2)
        with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
