import os, sys, time, torch, torch.nn.functional as F
torch.manual_seed(0)
shapes = [(576,576),(192,576),(192,576),(576,576),(1536,576),(1536,576),(576,1536)]
layers = [[torch.randn(o, i).bfloat16() for o, i in shapes] for _ in range(30)]
head = torch.randn(49152, 576).bfloat16()
allw = [w for ws in layers for w in ws] + [head]
allt = [w.t().contiguous() for w in allw]
x = torch.randn(576).bfloat16(); h = torch.randn(1536).bfloat16()
x2, h2 = x[None], h[None]
def ticks():
    out = []
    for t in os.listdir("/proc/self/task"):
        f = open(f"/proc/self/task/{t}/stat").read().split(")")[1].split()
        out.append(int(f[11]) + int(f[12]))
    return sorted(out)
def a():
    for w in allw: F.linear(h2 if w.shape[1] == 1536 else x2, w)
def b():
    for wt in allt: torch.mv(wt.t(), h if wt.shape[0] == 1536 else x)
def timed(f, n=3):
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n): f()
    return (time.perf_counter()-w0)/n*1e3, (time.process_time()-c0)/n*1e3
res = {}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    for t in (1, 2):
        torch.set_num_threads(t)
        for name, f in (("F.linear", a), ("mv n-layout", b)):
            res.setdefault((t, name), []).append(timed(f))
for k, v in res.items():
    ws = sorted(p for p, _ in v); cs = sorted(q for _, q in v); m = len(v)//2
    print(f"threads {k[0]} {k[1]:12s}: wall median {ws[m]:.1f} min {ws[0]:.1f} ms, cpu median {cs[m]:.1f} ms")
torch.set_num_threads(2); t0 = ticks(); b(); b(); b(); print("per-thread ticks for 3 n-layout steps", [q - p for p, q in zip(t0, ticks())])
print("load", os.getloadavg())
