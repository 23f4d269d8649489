import os, sys, time, warnings, torch, torch.nn.functional as F, statistics
warnings.simplefilter("ignore")
torch.manual_seed(0)
lin = torch.ops.quantized.linear_dynamic_fp16
shapes = [(576,576),(1536,576),(49152,576)]
for o,i in shapes:
    n = 1 if o == 49152 else 30
    Ws = [(torch.randn(o, i) * 0.05).bfloat16() for _ in range(n)]
    Qs = [torch.ops.quantized.linear_prepack_fp16(w.float(), None) for w in Ws]
    xb = torch.randn(1, i).bfloat16(); xf = xb.float()
    def a():
        for w in Ws: F.linear(xb, w)
    def b():
        for q in Qs: lin(xf, q)
    out = []
    for th in (1, 2):
        torch.set_num_threads(th)
        ra, rb = [], []
        for r in range(15):
            for f, res in ((a, ra), (b, rb)):
                t = time.perf_counter(); f(); res.append((time.perf_counter()-t)/n*1e6)
        out.append(f"{th}thr F.linear {statistics.median(ra):.0f} fp16 {statistics.median(rb):.0f}")
    print(f"{o}x{i}: " + " | ".join(out), "us")
