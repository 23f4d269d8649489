import os, sys, time, torch, torch.nn.functional as F
torch.manual_seed(0); torch.set_num_threads(2)
shapes = [(960,576),(576,576),(1536,576),(1536,576),(576,1536)]
allw = [(torch.randn(o, i) * 0.05).bfloat16() for _ in range(30) for o, i in shapes] + [(torch.randn(49152, 576) * 0.05).bfloat16()]
Q = [torch.ops.quantized.linear_prepack_fp16(w.float(), None) for w in allw]
inv = torch.tensor([2.0 ** -14])
R = int(sys.argv[1])
x = torch.randn(R, 576).bfloat16(); h = torch.randn(R, 1536).bfloat16()
def a():
    for w in allw: F.linear(h if w.shape[1] == 1536 else x, w)
def c():
    for w, q in zip(allw, Q): torch.ops.quantized.linear_dynamic_fp16((h if w.shape[1] == 1536 else x) * inv, q).to(torch.bfloat16)
def timed(f, n=1):
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n): f()
    return (time.perf_counter()-w0)/n*1e3, (time.process_time()-c0)/n*1e3
res = {}
for r in range(5):
    for name, f in (("F.linear", a), ("fp16 route", c)):
        res.setdefault(name, []).append(timed(f))
for k, v in res.items():
    ws = sorted(p for p, _ in v); cs = sorted(q for _, q in v); m = len(v)//2
    print(f"{R} rows {k:10s}: wall median {ws[m]:.1f} ms, cpu median {cs[m]:.1f} ms")
print("load", os.getloadavg())
