import torch, time, statistics, os
torch.set_num_threads(2)
L=30
J=[torch.randn(3072,576).to(torch.bfloat16) for _ in range(L)]
G=[(j[:1536], j[1536:]) for j in J]
x=torch.randn(1,576).to(torch.bfloat16)
fs={"two": lambda: [(torch.mm(x,g.t()), torch.mm(x,u.t())) for g,u in G],
    "joined": lambda: [torch.mm(x,j.t()) for j in J]}
res={k:[] for k in fs}
for r in range(30):
    for k,f in fs.items():
        t=time.perf_counter(); f(); res[k].append((time.perf_counter()-t)/L*1e6)
print(os.environ.get("OMP_WAIT_POLICY"), {k: round(statistics.median(v),1) for k,v in res.items()})
