"""Issue 12, stop 30: each decoder block's step compiled on its own (one Inductor graph for the 30 layers, weights as
inputs) against the eager step, paired rounds at a fixed position. Run: OMP_WAIT_POLICY=PASSIVE python docs/perf/bf16_12j/regional_block_compile.py
(a fresh TORCHINDUCTOR_CACHE_DIR for the cold compile time). Measured 2026-12-02 02:43 UTC: first call 31 s cold / 7 s warm,
eager 76.4 vs regional 83.0 ms a step (40 rounds); not adopted."""
import os, sys, time, statistics
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "bf16_12g")); sys.argv = sys.argv[:1]
import torch
from _folder import folder
import qkv
from qkv.nn.attention import step_scores_bias
from qkv.nn.position import PositionalEncoding
torch.set_num_threads(2)
m = qkv.from_pretrained(folder()).eval()
P, L = 32, 512
x = torch.randint(3, 49152, (1, P), generator=torch.Generator().manual_seed(0))

class LayerWrites:
    def __init__(self, k, v, index): self.k, self.v, self.index = k, v, index
    def update(self, layer, k, v):
        self.k.index_copy_(2, self.index, k); self.v.index_copy_(2, self.index, v); return self.k, self.v

def block_fn(block, rows, kb, vb, index, add, rotating, offset):
    return block.step(rows, 1, LayerWrites(kb, vb, index), 0, add, None, None, rotating, offset)
cblock = torch.compile(block_fn, fullgraph=True, dynamic=False)

def regional_step(ids, cache, index):
    st = m.decoder
    xx = st.position.embed(m.embed_target(ids), index)
    visible = (torch.arange(L) <= index).expand(1, L)
    a = st.blocks[0].attn
    add = step_scores_bias(batch=1, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, q_len=1, dtype=xx.dtype, device=xx.device, k_len=L, bias=None, keep=visible, causal=False)
    rows = xx.reshape(1, -1)
    rot = st.position
    for i, b in enumerate(st.blocks):
        rows = cblock(b, rows, cache.k[i], cache.v[i], index, add, rot, index)
    rows = st.final_norm(rows, None)
    return m.lm_head.step(rows)

with torch.no_grad():
    cache = m.make_cache(1, L)
    logits = m.prefill(x, cache) if False else None
    ref_cache = m.make_cache(1, L)
    m.prefill(x, ref_cache); m.prefill(x, cache)
    st = m.decoder; st.position.reserve(L)
    index = torch.tensor([P])
    ids = torch.full((1,1), 5)
    t = time.perf_counter(); out = regional_step(ids, cache, index); print("first call (compile) s", time.perf_counter()-t)
    ref = m.step(ids, ref_cache)
    print("max diff vs eager", (out.float()-ref.float()).abs().max().item(), out.argmax().item(), ref.argmax().item())
    def eager():
        r = m.step(ids, ref_cache); ref_cache.length = P; return r
    def reg():
        return regional_step(ids, cache, index)
    res = {"eager": [], "regional": []}
    for _ in range(3): eager(); reg()
    for r in range(40):
        for k, f in (("eager", eager), ("regional", reg)) if r % 2 else (("regional", reg), ("eager", eager)):
            t = time.perf_counter(); f(); res[k].append((time.perf_counter()-t)*1e3)
    for k, v in res.items(): print(k, round(statistics.median(v), 2), "ms")
