import os, time, torch, torch.nn.functional as F
torch.manual_seed(0)
torch.set_num_threads(2)
def ticks():
    s = 0
    for t in os.listdir("/proc/self/task"):
        f = open(f"/proc/self/task/{t}/stat").read().split(")")[1].split()
        s += int(f[11]) + int(f[12])
    return s
def bench(f, n):
    f(); a = ticks(); t0 = time.perf_counter(); c0 = time.process_time()
    for _ in range(n): f()
    return (time.perf_counter()-t0)/n*1e3, (time.process_time()-c0)/n*1e3
for out, inn in [(49152, 576), (1536, 576), (576, 1536), (576, 576)]:
    W = torch.randn(out, inn).bfloat16(); x = torch.randn(1, inn).bfloat16()
    ref = F.linear(x, W).float()
    routes = {"F.linear": lambda: F.linear(x, W)}
    try:
        wp = torch.ops.mkldnn._reorder_linear_weight(W, 1)
        routes["mkldnn_pointwise"] = lambda: torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [], "")
    except Exception as e: print("mkldnn", e)
    WT = W.t().contiguous()
    routes["mv n-layout"] = lambda: torch.mv(WT.t(), x[0])
    n = 10 if out > 10000 else 200
    for k, f in routes.items():
        try:
            d = (f().float().reshape(-1) - ref.reshape(-1)).abs().max().item()
            w, c = bench(f, n)
            print(f"{out}x{inn} {k}: wall {w:.3f} ms cpu {c:.3f} ms  cpu-GB/s {out*inn*2/c/1e6:.1f} d={d:.3g}")
        except Exception as e: print(k, "failed", str(e)[:200])
print(os.getloadavg())
