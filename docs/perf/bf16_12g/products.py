"""One-row products at the 135M Llama's shapes, 30 distinct weights each (the head: one), median of 5 passes, us a
product: torch's bf16 kernel (F.linear), torch's fp16 kernel (F.linear on fp16 copies), and fbgemm's fp16 GEMM
(torch.ops.quantized.linear_dynamic_fp16 on an fp32 input, as qkv's fp16 route; the route's input scaling and
rounding back to bf16 not included).

    OMP_WAIT_POLICY=PASSIVE python docs/perf/bf16_12g/products.py [threads]
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
torch.manual_seed(0)


def median_us(product, x, weights) -> float:
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for w in weights:
            product(x, w)
        times.append(time.perf_counter() - t)
    return statistics.median(times) / len(weights) * 1e6


for out, inp in [(960, 576), (576, 576), (1536, 576), (576, 1536), (3072, 576), (49152, 576)]:
    n = 1 if out == 49152 else 30
    wb = [torch.randn(out, inp).bfloat16() for _ in range(n)]
    wh = [w.half() for w in wb]
    packed = [torch.ops.quantized.linear_prepack_fp16(w.float(), None) for w in wb]
    xb = torch.randn(1, inp).bfloat16()
    xh, xf = xb.half(), xb.float()
    row = {"torch bf16": median_us(F.linear, xb, wb), "torch fp16": median_us(F.linear, xh, wh),
           "fbgemm fp16": median_us(torch.ops.quantized.linear_dynamic_fp16, xf, packed)}
    print(f"{out} x {inp}: " + ", ".join(f"{k} {v:.0f} us" for k, v in row.items()))
