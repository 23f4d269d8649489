"""Paired A/B of single batch-1 (or B-row) decoding steps at a fixed position: configurations of qkv.nn.linear's bf16
switches alternate step by step (order reversed every round), the cache cut back after each step so that every step
is the same work; prints each configuration's median and the median of its paired difference to the first.

    OMP_WAIT_POLICY=PASSIVE python docs/perf/bf16_12g/step_ab.py [FOLDER]   (env: B=1 POS=160 ROUNDS=200 CFGS=old,head)
"""

import os
import statistics
import time

import torch  # noqa: E402
from _folder import folder

import qkv  # noqa: E402
import qkv.nn.linear as L  # noqa: E402

torch.set_num_threads(2)
model = qkv.from_pretrained(folder()).eval()
P, B = int(os.environ.get("POS", "160")), int(os.environ.get("B", "1"))
x = torch.randint(3, 49152, (B, P), generator=torch.Generator().manual_seed(0))
cache = model.make_cache(B, P + 2)
ALL = {"old": dict(JOINT_STEP_BF16=False, STEP_FP16_ONE_ROW_MIN_WEIGHT=0),
       "joint": dict(JOINT_STEP_BF16=True, STEP_FP16_ONE_ROW_MIN_WEIGHT=0),  # at B >= linear.STEP_FP16_MIN_ROWS
       "head": dict(JOINT_STEP_BF16=False, STEP_FP16_ONE_ROW_MIN_WEIGHT=1 << 22)}
cfgs = {k: ALL[k] for k in os.environ.get("CFGS", "old,head").split(",")}
defaults = {n: getattr(L, n) for c in ALL.values() for n in c}
res = {k: [] for k in cfgs}
nxt = torch.full((B, 1), 5)


def use(c: dict) -> None:
    for n, v in {**defaults, **c}.items():
        setattr(L, n, v)


with torch.no_grad():
    model.prefill(x, cache)
    for c in cfgs.values():
        use(c)
        for _ in range(3):
            model.step(nxt, cache).argmax(-1)
            cache.length = P
    for r in range(int(os.environ.get("ROUNDS", "200"))):
        for k, c in (list(cfgs.items()) if r % 2 else list(cfgs.items())[::-1]):
            use(c)
            t = time.perf_counter()
            model.step(nxt, cache).argmax(-1)
            res[k].append((time.perf_counter() - t) * 1e3)
            cache.length = P
base = next(iter(cfgs))
for k in cfgs:
    d = [b - a for a, b in zip(res[base], res[k])]
    print(f"B={B} pos={P} {k}: median {statistics.median(res[k]):.2f} ms/step, paired difference to {base}: "
          f"median {statistics.median(d):+.2f} ms")
