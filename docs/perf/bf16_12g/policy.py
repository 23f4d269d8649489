"""One batch-1 bf16 decoding step of qkv and of transformers at the same position, alternating, in one process: the
ratio under the OpenMP wait policy this process was started with (OMP_WAIT_POLICY unset / PASSIVE / ACTIVE).

    OMP_WAIT_POLICY=PASSIVE python docs/perf/bf16_12g/policy.py [FOLDER]
"""

import os
import statistics
import time

import torch  # noqa: E402
import transformers  # noqa: E402
from _folder import folder

import qkv  # noqa: E402

torch.set_num_threads(2)
path = folder()
ours = qkv.from_pretrained(path).eval()
hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()
P = 160
x = torch.randint(3, 49152, (1, P), generator=torch.Generator().manual_seed(0))
nxt = torch.tensor([[5]])
res = {"qkv": [], "transformers": []}
with torch.no_grad():
    cache = ours.make_cache(1, P + 2)
    ours.prefill(x, cache)
    past = hf(x, use_cache=True).past_key_values

    def q():
        ours.step(nxt, cache).argmax(-1)
        cache.length = P

    def h():
        hf(nxt, past_key_values=past, use_cache=True).logits[:, -1].argmax(-1)
        past.crop(-1)

    for f in (q, h, q, h):
        f()
    for r in range(100):
        for k, f in ((("qkv", q), ("transformers", h)) if r % 2 else (("transformers", h), ("qkv", q))):
            s = time.perf_counter()
            f()
            res[k].append((time.perf_counter() - s) * 1e3)
mq, mh = statistics.median(res["qkv"]), statistics.median(res["transformers"])
print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}: qkv {mq:.2f} ms, transformers {mh:.2f} ms, "
      f"x transformers {mh / mq:.3f}")
