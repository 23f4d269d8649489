"""The engine's length split of the decoding batch (split_cost=4096, the default) vs one forward per decoding
step (split_cost=None), after the paged step stopped reading padding: Engine.run() over benchmarks/serve.py's
64 requests ('gpt-bench', 1024 positions, random weights), interleaved in one process, wall and CPU time.

    OMP_NUM_THREADS=2 python docs/perf/srv13c/split_ab.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))
import qkv  # noqa: E402
from qkv.generate import Engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    rnd = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    prompts = [torch.randint(0, 65, (rnd(16, 512),), generator=g).tolist() for _ in range(64)]
    news = [rnd(16, 256) for _ in range(64)]
    torch.manual_seed(0)
    m = qkv.build("gpt-bench", context_length=1024, position="learned").eval()
    res: dict[str, list[tuple[float, float]]] = {"4096": [], "None": []}
    outs = {}
    for i in range(a.rounds):
        for name in ("4096", "None") if i % 2 == 0 else ("None", "4096"):
            e = Engine(m, max_batch_size=64, split_cost=None if name == "None" else int(name))
            rids = [e.add_request(p, n) for p, n in zip(prompts, news)]
            t0, c0 = time.perf_counter(), time.process_time()
            out = e.run()
            res[name].append((time.perf_counter() - t0, time.process_time() - c0))
            outs[name] = [out[r] for r in rids]
            print(name, res[name][-1], flush=True)
    tok = sum(news)
    for name, v in res.items():
        w, c = statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)
        print(f"split_cost={name}: {tok / w:.1f} tok/s wall, {c:.2f} s CPU (medians of {a.rounds})")
    print("same tokens:", outs["4096"] == outs["None"])


if __name__ == "__main__":
    main()
