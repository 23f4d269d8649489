# stop 23 quiet-pass micro-benchmark (docs/perf/bf16_12d.md, last section); run from the repo root: .venv/bin/python docs/perf/stop23/tiles_layers.py
import torch, time, statistics
import torch.nn.functional as F
from qkv.nn.linear import bf16_tiled_linear
torch.set_num_threads(2)
torch.manual_seed(0)
# the Llama-135M layer's weights, 30 layers (not cache resident)
shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
Ws = [torch.randn(*s, dtype=torch.bfloat16) for _ in range(30) for s in shapes]
def run(M, f):
    x = torch.randn(M, 576, dtype=torch.bfloat16); x2 = torch.randn(M, 1536, dtype=torch.bfloat16)
    def go():
        for W in Ws:
            f(x if W.shape[1] == 576 else x2, W)
    return go
with torch.no_grad():
    for M in (4, 8, 16, 32, 64):
        fa, fb = run(M, F.linear), run(M, bf16_tiled_linear)
        fa(); fb()
        ta, tb = [], []
        for _ in range(3):
            t0 = time.perf_counter(); fa(); ta.append(time.perf_counter() - t0)
            t0 = time.perf_counter(); fb(); tb.append(time.perf_counter() - t0)
        a, b = statistics.median(ta) * 1e3, statistics.median(tb) * 1e3
        print(f"M={M}: F.linear {a:.1f} ms, tiles {b:.1f} ms, tiles speedup {a/b:.2f}x", flush=True)
