"""Decode step A/B in one process: qkv generate with STEP_BF16_VIA_FP16 on/off, wall + CPU time, interleaved.

The record of round 7 (docs/perf/bf16_12e.md), kept as it was run. Since stop 24 one-row products keep F.linear
(linear.STEP_FP16_MIN_ROWS = 2) and STEP_FP16_SERIAL_MAX is gone: setting it below does nothing, so at batch 1 the
three rows now time the same code.
"""
import os, sys, time, statistics, tempfile, torch, transformers
sys.path.insert(0, "benchmarks")
import qkv
from qkv.generate import generate
from qkv.nn import linear
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
torch.manual_seed(0)
cfg = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
           num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5)
hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, bos_token_id=1, eos_token_id=2)).eval().to(torch.bfloat16)
d = tempfile.mkdtemp(); hf.save_pretrained(d); m = qkv.from_pretrained(d)
x = torch.randint(3, 49152, (1, 32), generator=torch.Generator().manual_seed(1))
N = int(sys.argv[1]) if len(sys.argv) > 1 else 32
calls = {"n": 0}
orig = linear.Linear._fp16_packed
def counted(self):
    calls["n"] += 1; return orig(self)
linear.Linear._fp16_packed = counted
def run(on):
    linear.STEP_BF16_VIA_FP16 = on != "off"
    linear.STEP_FP16_SERIAL_MAX = 0 if on == "2thr" else 1 << 21
    with torch.no_grad():
        w0, c0 = time.perf_counter(), time.process_time()
        out = generate(m, x, max_new_tokens=N, min_new_tokens=N)
        return out, (time.perf_counter() - w0) / N * 1e3, (time.process_time() - c0) / N * 1e3
a, _, _ = run("on"); print("fp16 calls per token", calls["n"] / N)
b, _, _ = run("off"); print("tokens equal on/off:", torch.equal(a, b))
V = ("on", "off", "2thr")
res = {v: [] for v in V}
for r in range(int(sys.argv[3]) if len(sys.argv) > 3 else 5):
    for on in V:
        res[on].append(run(on)[1:])
for on in V:
    print(f"fp16 step {on}: wall median {statistics.median(w for w, _ in res[on]):.1f} ms/step (min {min(w for w, _ in res[on]):.1f}), "
          f"cpu median {statistics.median(c for _, c in res[on]):.1f} ms/step")
print("load", os.getloadavg())
