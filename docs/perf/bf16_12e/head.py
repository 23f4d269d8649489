import os, sys, time, torch, torch.nn.functional as F
torch.manual_seed(0); torch.set_num_threads(2)
W = (torch.randn(49152, 576) * 0.05).bfloat16(); Q = torch.ops.quantized.linear_prepack_fp16(W.float(), None)
others = [torch.randn(3_000_000) for _ in range(8)]  # 96 MB to flush caches between calls
xf = torch.randn(1, 576)
def run(t):
    torch.set_num_threads(t)
    for o in others: o.sum()
    w0 = time.perf_counter(); c0 = time.process_time()
    torch.ops.quantized.linear_dynamic_fp16(xf, Q)
    return time.perf_counter() - w0, time.process_time() - c0
res = {1: [], 2: []}
for r in range(25):
    for t in (1, 2): res[t].append(run(t))
for t in (1, 2):
    ws = sorted(a for a, _ in res[t]); cs = sorted(b for _, b in res[t])
    print(f"head qdyn {t} thr: wall median {ws[12]*1e3:.2f} min {ws[0]*1e3:.2f} ms; cpu median {cs[12]*1e3:.2f}")
print(os.getloadavg())
