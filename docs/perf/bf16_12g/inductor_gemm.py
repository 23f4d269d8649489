"""One-row bf16 products of the 135M Llama's layer shapes (30 distinct weights each, so nothing stays in the cache):
torch's eager kernel vs Inductor's CPP GEMM template (torch.compile with freezing and max_autotune: the weights
become constants of the graph and are packed for its micro-kernel). A measurement for the notes, not a qkv path.

    OMP_WAIT_POLICY=PASSIVE python docs/perf/bf16_12g/inductor_gemm.py
"""

import statistics
import time

import torch
import torch._inductor.config as ic

ic.freezing = True
ic.max_autotune = True
ic.max_autotune_gemm_backends = "CPP,ATEN"
torch.set_num_threads(2)
torch.manual_seed(0)


class Products(torch.nn.Module):
    def __init__(self, n: int, out: int, inp: int) -> None:
        super().__init__()
        self.ls = torch.nn.ModuleList(torch.nn.Linear(inp, out, bias=False) for _ in range(n))

    def forward(self, x):
        return [lin(x) for lin in self.ls]


for out, inp in [(1536, 576), (576, 1536), (960, 576)]:
    m = Products(30, out, inp).to(torch.bfloat16).eval()
    x = torch.randn(1, inp).bfloat16()
    with torch.no_grad():
        ref = m(x)
        t = time.perf_counter()
        c = torch.compile(m)
        c(x)
        compile_s = time.perf_counter() - t
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ref, c(x)))
        te, tc = [], []
        for _ in range(20):
            s = time.perf_counter()
            m(x)
            te.append(time.perf_counter() - s)
            s = time.perf_counter()
            c(x)
            tc.append(time.perf_counter() - s)
    print(f"{out} x {inp}: eager {statistics.median(te) / 30 * 1e6:.0f} us, Inductor CPP GEMM "
          f"{statistics.median(tc) / 30 * 1e6:.0f} us a product (compile {compile_s:.0f} s, max |diff| {diff:.4f})")
