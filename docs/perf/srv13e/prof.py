"""Engine.run() on benchmarks/serve.py's issue load (64 requests, prompts 16..512, outputs 16..256, gpt-bench), from
the source tree given first (default src):  prof.py SRC [time ROUNDS | prof]   (prof: torch.profiler op table)."""
import os, sys, time, tempfile, json
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
src = sys.argv[1] if len(sys.argv) > 1 else "src"
sys.path.insert(0, src)
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3] / "benchmarks"))
import torch
from qkv.generate import Engine  # before benchmarks/serve.py, which puts this worktree's src first on the path
from qkv.serve import load_served
import qkv
import serve as bench
print("qkv", qkv.__file__)
from pathlib import Path
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
rnd = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))
prompts = [torch.randint(0, 65, (rnd(16, 512),), generator=g).tolist() for _ in range(64)]
news = [rnd(16, 256) for _ in range(64)]
tmp = tempfile.mkdtemp()
folder = bench.make_folder(Path(tmp) / "model", False)
m = load_served(folder).model
mode = sys.argv[2] if len(sys.argv) > 2 else "time"
def once():
    e = Engine(m, max_batch_size=64)
    rids = [e.add_request(p, n) for p, n in zip(prompts, news)]
    c0, t0 = time.process_time(), time.perf_counter()
    out = e.run()
    return time.perf_counter() - t0, time.process_time() - c0, [out[r] for r in rids], e
once()
if mode == "prof":
    from torch.profiler import profile
    with profile() as p:
        w, c, ids, e = once()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    print("wall", w, "cpu", c, "steps", e.steps)
else:
    for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 2):
        w, c, ids, e = once()
        print(f"wall {w:.2f} cpu {c:.2f} tok/s {sum(news)/w:.1f} steps {e.steps}", flush=True)
    import hashlib; print("digest", hashlib.md5(json.dumps(ids).encode()).hexdigest())
