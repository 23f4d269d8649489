import sys, time, statistics, tempfile
import torch, transformers, qkv
torch.set_num_threads(2)
torch.manual_seed(0)
cfg=dict(vocab_size=256, hidden_size=72, intermediate_size=96, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, head_dim=8)
p=tempfile.mkdtemp()
transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(torch.bfloat16).save_pretrained(p)
m=qkv.from_pretrained(p).eval()
P=160
x = torch.randint(3, 256, (1, P))
cache = m.make_cache(1, P + 2)
nxt = torch.full((1, 1), 5)
with torch.no_grad():
    m.prefill(x, cache)
    ts=[]
    for _ in range(200):
        t=time.perf_counter(); m.step(nxt, cache).argmax(-1); ts.append(time.perf_counter()-t); cache.length = P
print("tiny step ms", statistics.median(ts)*1e3)
