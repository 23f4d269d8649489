# stop 23 quiet-pass micro-benchmark (docs/perf/bf16_12d.md, last section); run from the repo root: .venv/bin/python docs/perf/stop23/tiles_head.py
import torch, time, statistics
import torch.nn.functional as F
from qkv.nn.linear import bf16_tiled_linear
torch.set_num_threads(2)
W = torch.randn(49152, 576, dtype=torch.bfloat16)
for M in (8, 16):
    x = torch.randn(M, 576, dtype=torch.bfloat16)
    with torch.no_grad():
        ta, tb = [], []
        for _ in range(5):
            t0 = time.perf_counter(); F.linear(x, W); ta.append(time.perf_counter() - t0)
            t0 = time.perf_counter(); bf16_tiled_linear(x, W); tb.append(time.perf_counter() - t0)
    a, b = statistics.median(ta) * 1e3, statistics.median(tb) * 1e3
    print(f"lm_head M={M}: F.linear {a:.1f} ms, tiles {b:.1f} ms")
