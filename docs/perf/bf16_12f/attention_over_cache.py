import sys, time, statistics, torch
sys.path.insert(0, "src")  # run from the repository root
from qkv.nn.attention import _bf16_step_products
torch.set_num_threads(1)
for T in (160, 1024, 2048):
    L = 30
    ks = [torch.randn(1, 3, T, 64).bfloat16() for _ in range(L)]; vs = [torch.randn(1, 3, T, 64).bfloat16() for _ in range(L)]
    kf = [k.float().reshape(3, T, 64) for k in ks]; vf = [v.float().reshape(3, T, 64) for v in vs]
    qg = torch.randn(3, 3, 64).bfloat16()
    def a():
        for k, v in zip(ks, vs): _bf16_step_products(qg, k, v, None, 3, T, 64)
    def m():
        for k, v in zip(kf, vf):
            s = torch.bmm(qg.float(), k.transpose(1, 2))
            p = torch.softmax(s.to(torch.bfloat16), -1)
            torch.bmm(p.float(), v).to(torch.bfloat16)
    ra, rm = [], []
    for r in range(9):
        for f, res in ((a, ra), (m, rm)):
            t = time.perf_counter(); f(); res.append((time.perf_counter() - t) * 1e3)
    print(f"T={T}: 30 layers, 1 thread: converting the cache {statistics.median(ra):.2f} ms, fp32 mirror {statistics.median(rm):.2f} ms")
