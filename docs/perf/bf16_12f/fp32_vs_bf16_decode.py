import sys, time, statistics, torch
sys.path.insert(0, "src")  # run from the repository root
import qkv
from qkv.generate import generate
torch.set_num_threads(2)
b = qkv.from_pretrained(sys.argv[1]).eval()
f = qkv.from_pretrained(sys.argv[1]).eval().float()
x = torch.randint(4, 1000, (1, 32), generator=torch.Generator().manual_seed(0))
N = 128; res = {}; toks = {}
for r in range(4):
    for name, m in (("bf16", b), ("fp32", f)):
        t = time.perf_counter(); out = generate(m, x, max_new_tokens=N, min_new_tokens=N); res.setdefault(name, []).append((time.perf_counter() - t) / N * 1e3)
        toks[name] = out[0, 32:]
print({k: round(statistics.median(v), 1) for k, v in res.items()}, {k: [round(a, 1) for a in v] for k, v in res.items()})
print("tokens equal share", (toks["bf16"] == toks["fp32"]).float().mean().item())
