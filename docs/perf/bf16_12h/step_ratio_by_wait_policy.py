import os, sys, time, statistics
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "bf16_12g"))
import torch
from _folder import folder
import qkv, transformers
from transformers import DynamicCache
torch.set_num_threads(2)
m = qkv.from_pretrained(folder()).eval()
hf = transformers.LlamaForCausalLM.from_pretrained(folder(), dtype=torch.bfloat16).eval()
P=160
x = torch.randint(3, 49152, (1, P), generator=torch.Generator().manual_seed(0))
cache = m.make_cache(1, P + 2)
nxt = torch.full((1, 1), 5)
res={"qkv":[], "hf":[]}
with torch.no_grad():
    m.prefill(x, cache)
    out = hf(x, use_cache=True); pkv = out.past_key_values
    pos = torch.tensor([[P]])
    def hstep():
        o = hf(nxt, past_key_values=pkv, position_ids=pos, use_cache=True, logits_to_keep=1)
        pkv.crop(-1)
        return o.logits.argmax(-1)
    def qstep():
        r = m.step(nxt, cache).argmax(-1); cache.length = P; return r
    for _ in range(5): hstep(); qstep()
    for r in range(int(os.environ.get("R","60"))):
        for k,f in (("qkv",qstep),("hf",hstep)) if r%2 else (("hf",hstep),("qkv",qstep)):
            t=time.perf_counter(); f(); res[k].append((time.perf_counter()-t)*1e3)
q,h=statistics.median(res["qkv"]),statistics.median(res["hf"])
print(os.environ.get("OMP_WAIT_POLICY","unset"), f"qkv {q:.1f} hf {h:.1f} ratio {h/q:.2f}")
