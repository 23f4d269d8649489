import os, sys, time, tempfile, statistics, cProfile, pstats
from pathlib import Path
sys.path.insert(0, "benchmarks")
import torch, qkv, qkv.nn.linear as L
import torch.nn.functional as F
from prefill import build
torch.set_num_threads(2)
tmp = Path(tempfile.mkdtemp())
hf, ours = build("llama", False, tmp, 300)
hf = hf.to(torch.bfloat16); hf.save_pretrained(tmp / "bf"); ours = qkv.from_pretrained(tmp / "bf").eval()
nxt = torch.full((1, 1), 5)
real = F.linear
outs = {}
def fake(x, w, b=None):
    k = (x.shape[:-1], w.shape[0])
    o = outs.get(k)
    if o is None: o = outs[k] = real(x, w, b)
    return o.clone()
if os.environ.get("STUB"): L.F.linear = fake
P = 160
x = torch.randint(4, 1000, (1, P))
with torch.no_grad():
    cache = ours.make_cache(1, P + 2); ours.prefill(x, cache)
    def step():
        ours.step(nxt, cache).argmax(-1); cache.length = P
    for _ in range(5): step()
    pr = cProfile.Profile(); pr.enable()
    for _ in range(20): step()
    pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(35)
