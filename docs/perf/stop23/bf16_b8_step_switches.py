# stop 23 quiet-pass micro-benchmark (docs/perf/bf16_12d.md, last section); run from the repo root: .venv/bin/python docs/perf/stop23/bf16_b8_step_switches.py
import sys, tempfile, torch, time, statistics
from pathlib import Path
sys.path.insert(0, "benchmarks")
torch.set_num_threads(2)
from prefill import build
from _step_switches import previous_bf16
from qkv.nn import linear, attention
from torch.profiler import profile, ProfilerActivity
hf, ours = build("llama", False, Path(tempfile.mkdtemp()), 40)
ours = ours.to(torch.bfloat16)
B = 8
x = torch.randint(4, 1000, (B, 32)); nxt = torch.full((B, 1), 5)
with torch.no_grad():
    cache = ours.make_cache(B, 34); ours.prefill(x, cache)
    def st():
        ours.step(nxt, cache).argmax(-1); cache.length = 32
    import contextlib
    def tiles_off():
        old = linear.BF16_TILE_MIN_ROWS; linear.BF16_TILE_MIN_ROWS = 0
        try: st()
        finally: linear.BF16_TILE_MIN_ROWS = old
    def attn_off():
        old = attention.STEP_BF16_FP32_PRODUCTS; attention.STEP_BF16_FP32_PRODUCTS = False
        try: st()
        finally: attention.STEP_BF16_FP32_PRODUCTS = old
    def all_off():
        with previous_bf16(): st()
    fns = {"new": st, "tiles off": tiles_off, "attn off": attn_off, "all off": all_off}
    for f in fns.values(): f(); f()
    T = {k: [] for k in fns}
    for r in range(5):
        for k, f in (fns.items() if r % 2 == 0 else reversed(list(fns.items()))):
            t0 = time.perf_counter(); f(); f(); T[k].append((time.perf_counter() - t0) / 2 * 1e3)
    for k, v in T.items(): print(k, "%.1f ms" % statistics.median(v))
    for name, f in (("new", st), ("all off", all_off)):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(3): f()
        print(name); print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
