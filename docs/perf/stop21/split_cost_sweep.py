import sys, time, statistics, tempfile, torch
from pathlib import Path
sys.path.insert(0, "benchmarks")
import serve as S
from qkv.generate.engine import Engine
torch.set_num_threads(2)
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
rnd = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))
prompts = [torch.randint(0, 65, (rnd(16, 512),), generator=g).tolist() for _ in range(64)]
news = [rnd(16, 256) for _ in range(64)]
with tempfile.TemporaryDirectory() as tmp:
    folder = S.make_folder(Path(tmp), False)
    m = S.load_served(folder).model
    splits = [4096, 16384, 65536, None]
    t = {s: [] for s in splits}
    for r in range(2):
        for s in (splits if r % 2 == 0 else splits[::-1]):
            t0 = time.perf_counter(); e = Engine(m, max_batch_size=64, split_cost=s)
            for p, n in zip(prompts, news): e.add_request(p, n)
            e.run(); t[s].append(time.perf_counter() - t0)
            print(s, round(t[s][-1], 2), flush=True)
    for s in splits: print("split", s, "median s", round(statistics.median(t[s]), 2), "tok/s", round(sum(news) / statistics.median(t[s]), 1))
