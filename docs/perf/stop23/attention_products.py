# stop 23 quiet-pass micro-benchmark (docs/perf/bf16_12d.md, last section); run from the repo root: .venv/bin/python docs/perf/stop23/attention_products.py
import torch, time, statistics
from qkv.nn.attention import _bf16_step_products
torch.set_num_threads(2)
for B in (1, 8):
  for Tk in (64, 288):
    n, G, hd = B * 3, 3, 64
    q = torch.randn(n, G, hd, dtype=torch.bfloat16)
    k = torch.randn(B, 3, Tk, hd, dtype=torch.bfloat16); v = torch.randn(B, 3, Tk, hd, dtype=torch.bfloat16)
    def old():
        kt = k.reshape(n, Tk, hd).transpose(1, 2)
        p = torch.softmax(torch.bmm(q, kt), -1)
        return torch.bmm(p, v.reshape(n, Tk, hd))
    def new():
        return _bf16_step_products(q, k, v, None, n, Tk, hd)
    with torch.no_grad():
        ta, tb = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(30): old()
            ta.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(30): new()
            tb.append(time.perf_counter() - t0)
    a, b = statistics.median(ta) / 30 * 1e6, statistics.median(tb) / 30 * 1e6
    print(f"B={B} Tk={Tk}: bf16 bmm {a:.0f} us, fp32 products {b:.0f} us, speedup {a/b:.2f}x")
