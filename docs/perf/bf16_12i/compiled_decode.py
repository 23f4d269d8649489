"""Batch-1 bf16 greedy decoding of the issue's 135M-class Llama, four ways in interleaved rounds: transformers'
generate as it comes (dynamic cache, eager), transformers with its static cache compiled (cache_implementation=
"static" + a CompileConfig, forced on the CPU with _compile_all_devices), qkv eager, qkv compile=True (the static
step compiled by Inductor, generate/graphed.py). ms per new token over a whole generate() call (prompt 32,
--new tokens; the prefill is amortised the same way in every row); the warm-up call compiles and is reported.

    OMP_WAIT_POLICY=PASSIVE python docs/perf/bf16_12i/compiled_decode.py [FOLDER] [--new 128] [--rounds 4]
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bf16_12g"))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))

import torch  # noqa: E402
import transformers  # noqa: E402
from _folder import folder  # noqa: E402
from transformers import CompileConfig  # noqa: E402

import qkv  # noqa: E402
from qkv.generate import generate  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("folder", nargs="?")
p.add_argument("--new", type=int, default=128)
p.add_argument("--rounds", type=int, default=4)
a = p.parse_args()
torch.set_num_threads(2)
path = folder()
ours = qkv.from_pretrained(path).eval()
hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
hf_static = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
ids = torch.randint(0, 49152, (1, 32), generator=torch.Generator().manual_seed(0))
compile_config = CompileConfig(fullgraph=True)
compile_config._compile_all_devices = True  # transformers compiles only on accelerators unless told


def transformers_generate(model, **kw):
    def run(n):
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0, **kw)
    return run


def qkv_generate(compile):
    return lambda n: generate(ours, ids, max_new_tokens=n, do_sample=False, compile=compile, eos_token_id=[])


rows = {"transformers": transformers_generate(hf),
        "transformers static+compile": transformers_generate(hf_static, cache_implementation="static",
                                                             compile_config=compile_config),
        "qkv": qkv_generate(False), "qkv compile=True": qkv_generate(True)}
for name, fn in rows.items():
    t = time.perf_counter()
    fn(a.new)
    print(f"{name}: warm-up (compiles) {time.perf_counter() - t:.1f} s", flush=True)
times = {k: [] for k in rows}
for r in range(a.rounds):
    for name, fn in rows.items():
        t = time.perf_counter()
        fn(a.new)
        times[name].append((time.perf_counter() - t) / a.new * 1e3)
    print(r, {k: round(v[-1], 1) for k, v in times.items()}, flush=True)
med = {k: statistics.median(v) for k, v in times.items()}
print("| | ms / new token (median) | vs transformers | vs transformers static+compile |\n|---|---|---|---|")
for k, v in med.items():
    print(f"| {k} | {v:.1f} | {med['transformers'] / v:.2f}x | {med['transformers static+compile'] / v:.2f}x |")
