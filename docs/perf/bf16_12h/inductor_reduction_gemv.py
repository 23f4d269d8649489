import torch, time, statistics
torch.set_num_threads(2)
torch.manual_seed(0)
L=30
s=(1536,576)
Ws=[torch.randn(*s).to(torch.bfloat16) for _ in range(L)]
x=torch.randn(1,s[1]).to(torch.bfloat16)
def red(a,w):
    return (a.float() * w.float()).sum(-1).to(torch.bfloat16)
def red30(a, ws):
    return [ (a.float() * w.float()).sum(-1).to(torch.bfloat16) for w in ws]
t=time.perf_counter()
c=torch.compile(red, dynamic=False)
c(x,Ws[0]); print("compile s", time.perf_counter()-t)
t=time.perf_counter()
c30=torch.compile(red30, dynamic=False)
c30(x,Ws); print("compile30 s", time.perf_counter()-t)
fs={"mm": lambda: [torch.mm(x,w.t()) for w in Ws], "ind": lambda: [c(x,w) for w in Ws], "ind30": lambda: c30(x, Ws)}
res={k:[] for k in fs}
for r in range(20):
    for k,f in fs.items():
        t=time.perf_counter(); f(); res[k].append((time.perf_counter()-t)/L*1e6)
print({k: round(statistics.median(v),1) for k,v in res.items()})
ref=torch.mm(x.double(),Ws[0].double().t())
print(float((c(x,Ws[0]).double()-ref).abs().max()), float((torch.mm(x,Ws[0].t()).double()-ref).abs().max()))
