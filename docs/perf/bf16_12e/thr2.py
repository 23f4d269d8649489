import os, sys, time, warnings, torch, torch.nn.functional as F
warnings.simplefilter("ignore")
torch.manual_seed(0)
torch.set_num_threads(2)
shapes = [(960,576),(576,576),(1536,576),(1536,576),(576,1536)]
allw = [(torch.randn(o, i) * 0.05).bfloat16() for _ in range(30) for o, i in shapes] + [(torch.randn(49152, 576) * 0.05).bfloat16()]
Q = [torch.ops.quantized.linear_prepack_fp16(w.float(), None) for w in allw]
P = [torch.fbgemm_pack_gemm_matrix_fp16(w.float()) for w in allw]
Z = [torch.zeros(w.shape[0]) for w in allw]
inv = torch.tensor([2.0 ** -14])
x = torch.randn(1, 576).bfloat16(); h = torch.randn(1, 1536).bfloat16()
xf, hf = x.float(), h.float()
def a():
    for w in allw: F.linear(h if w.shape[1] == 1536 else x, w)
def q(): 
    for w, p in zip(allw, Q): torch.ops.quantized.linear_dynamic_fp16(hf if w.shape[1] == 1536 else xf, p)
def d():
    for w, p, z in zip(allw, P, Z): torch.fbgemm_linear_fp16_weight_fp32_activation(hf if w.shape[1] == 1536 else xf, p, z)
def prep():
    for w in allw: ((h if w.shape[1] == 1536 else x) * inv).to(torch.bfloat16)
def one(f):
    def g():
        torch.set_num_threads(1)
        try: f()
        finally: torch.set_num_threads(2)
    return g
def timed(f, n=3):
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n): f()
    return (time.perf_counter()-w0)/n*1e3, (time.process_time()-c0)/n*1e3
res = {}
for r in range(int(sys.argv[1])):
    for name, f in (("F.linear 2thr", a), ("qdyn 2thr", q), ("qdyn 1thr", one(q)), ("fbgemm-depr 2thr", d), ("prep ops only", prep)):
        res.setdefault(name, []).append(timed(f))
for k, v in res.items():
    ws = sorted(p for p, _ in v); cs = sorted(q for _, q in v); m = len(v)//2
    print(f"{k:16s}: wall median {ws[m]:.1f} min {ws[0]:.1f} ms, cpu median {cs[m]:.1f} ms")
print("load", os.getloadavg())
