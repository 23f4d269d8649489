"""A 135M-class Llama (SmolLM-135M's shape, random weights): qkv vs transformers on the same folder.

Model: LlamaConfig(30 layers, hidden 576, 9 query / 3 key-value heads, intermediate 1536, vocab 49152, tied
embeddings), built with random weights by transformers, saved to a temporary folder in fp32 and in bf16, and
loaded by both libraries from that folder. Measured, side by side in one run:
  load     peak resident memory while loading the folder, in a fresh subprocess per library and dtype:
           (VmHWM after - VmRSS before) / bytes of the weights
  decode   greedy decoding, prompt 32, --new tokens (eos never stops it), batch 1 and 8, fp32 and bf16:
           tok/s and ms/step of qkv.generate vs transformers' generate; the memory-bandwidth floor of a step
           is weight bytes / a measured read bandwidth (a sum over a 1 GiB tensor)
  prefill  one forward over a 512-token prompt (logits of the last position only, in both)
Every timed configuration runs --repeats times, interleaved (round robin); the table reports medians. The
machine is shared: only ratios within one run mean much.

    .venv/bin/python benchmarks/llm.py [--quick] [--threads 2] [--new 256] [--repeats 3] [--ab] [--ab-tiles] [--ab-12g]

--ab: at batch > 1 a third library row, "qkv mkl-step": qkv with the batched step's products through MKL as before
issue 12's fix (qkv.nn.linear.STEP_PACKED_MIN_ROWS = 0), timed in the same interleaved rounds; at batch 1 a row
"qkv previous step": qkv with step12c's batch-1 fast paths off (benchmarks/_step_switches.py).

--ab-tiles: for bf16 weights a row "qkv bf16 before": qkv with its bf16 paths for CPUs without native bf16 off
(products of several rows through fp32 tiles of the weight, the step's attention products in fp32, RMSNorm.step's bf16
row: _step_switches.previous_bf16), in the same interleaved rounds, decode and prefill.
With --ab-tiles also a row "qkv no fp16 step": only the bf16 step's fp16 copy off (linear.STEP_BF16_VIA_FP16,
_step_switches.previous_fp16_step; docs/perf/bf16_12e.md), decode only.

--ab-12g: for bf16 weights a row "qkv before 12g": qkv without docs/perf/bf16_12g.md's routes (the output head's
one-row product through its fp16 copy; a batch's gate and up through one joined fp16 copy;
_step_switches.previous_12g), in the same interleaved rounds, decode only.

--quick: a 2-layer model of width 64, bf16 only, batch 1, 8 tokens (the smoke test, tests/test_benchmark_llm.py).
Writes benchmarks/results/llm.json and llm.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/generate.py

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

import qkv  # noqa: E402
import qkv.nn.linear  # noqa: E402
from _step_switches import previous_12g, previous_bf16, previous_fp16_step, previous_step  # noqa: E402
from _timing import interleaved  # noqa: E402
from qkv.generate import generate  # noqa: E402

FULL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=10000.0)
QUICK = dict(FULL, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)

_LOAD_PROBE = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[3])
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
if sys.argv[2] == "qkv":
    import qkv
    before = rss("VmRSS:")
    model = qkv.from_pretrained(sys.argv[1])
else:
    import transformers
    before = rss("VmRSS:")
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype="auto")
peak = rss("VmHWM:")
nbytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
print(json.dumps({"before": before, "peak": peak, "weights": nbytes,
                  "dtype": str(next(model.parameters()).dtype)}))
"""


def load_peak(folder: Path, library: str) -> dict:
    """Peak RSS growth while loading `folder` with `library`, in a fresh process (imports done first)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _LOAD_PROBE, str(folder), library, str(ROOT.parent / "src")],
                       capture_output=True, text=True, env=env, timeout=600)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    d = json.loads(r.stdout.strip().splitlines()[-1])
    d["ratio"] = round((d["peak"] - d["before"]) / d["weights"], 3)
    return d


def read_bandwidth() -> float:
    """GB/s of a plain read: the sum over a 1 GiB fp32 tensor (median of 5)."""
    x = torch.ones(256 * 1024 * 1024)
    x.sum()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def _without_packed_step(fn):
    """fn() with Linear.step's batched oneDNN path off (the MKL products of the step before issue 12's fix)."""
    old, qkv.nn.linear.STEP_PACKED_MIN_ROWS = qkv.nn.linear.STEP_PACKED_MIN_ROWS, 0
    try:
        return fn()
    finally:
        qkv.nn.linear.STEP_PACKED_MIN_ROWS = old


def _bf16_before(fn):
    """fn() with bf16 as before issue 12's bf16 passes (benchmarks/_step_switches.py previous_bf16)."""
    with previous_bf16():
        return fn()


def _no_fp16_step(fn):
    """fn() with only the bf16 step's fp16 copy off (benchmarks/_step_switches.py previous_fp16_step)."""
    with previous_fp16_step():
        return fn()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a tiny model and a few tokens (smoke test)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--ab", action="store_true", help="also time qkv without the packed batched step (batch > 1)")
    ap.add_argument("--ab-tiles", action="store_true", help="also time bf16 qkv as before its bf16 paths")
    ap.add_argument("--ab-12g", action="store_true", help="also time bf16 qkv without bf16_12g's fp16 routes")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args()
    if a.quick:
        a.new, a.repeats, a.prefill, a.batches, a.dtypes = 8, 1, 32, [1], ["bfloat16"]
    torch.set_num_threads(a.threads)
    import transformers

    spec = QUICK if a.quick else FULL
    torch.manual_seed(0)
    hf32 = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec, bos_token_id=1, eos_token_id=2)).eval()
    tmp = Path(tempfile.mkdtemp(prefix="qkv-llm-bench-"))
    folders, models = {}, {}
    for name in a.dtypes:
        dtype = getattr(torch, name)
        folders[name] = tmp / name
        hf = hf32 if dtype == torch.float32 else hf32.to(dtype) if "float32" not in folders else \
            transformers.LlamaForCausalLM.from_pretrained(folders["float32"], dtype=dtype).eval()
        hf.save_pretrained(folders[name])
        hf.generation_config.eos_token_id = None  # decode the full length in both libraries
        models[name] = (hf, qkv.from_pretrained(folders[name]))
        assert next(models[name][1].parameters()).dtype == dtype
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "threads": a.threads,
            "machine": platform.processor() or platform.machine(), "quick": a.quick, "model": spec,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "native_bf16": qkv.nn.linear.native_bf16(),
            "prompt": a.prompt, "new_tokens": a.new, "prefill": a.prefill, "repeats": a.repeats,
            "note": "shared, loaded machine: medians of interleaved repeats; compare ratios within this run"}

    libraries = ("qkv",) if a.quick else ("qkv", "transformers")  # quick: the probe runs, the figure means nothing
    load = {f"{lib} {name}": load_peak(folders[name], lib) for name in a.dtypes for lib in libraries}
    gbps = read_bandwidth()

    rows, agree = [], {}
    for name in a.dtypes:
        hf, ours = models[name]
        weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
        floor_ms = weight_bytes / (gbps * 1e9) * 1000
        for B in a.batches:
            x = torch.randint(3, spec["vocab_size"], (B, a.prompt), generator=torch.Generator().manual_seed(B))
            fns = {
                "qkv": lambda x=x, m=ours: generate(m, x, max_new_tokens=a.new, min_new_tokens=a.new),
                "transformers": lambda x=x, m=hf: m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=a.new,
                                                             min_new_tokens=a.new, do_sample=False, pad_token_id=0),
            }
            if a.ab and B == 1:
                def previous(x=x, m=ours):
                    with previous_step():
                        return generate(m, x, max_new_tokens=a.new, min_new_tokens=a.new)
                fns["qkv previous step"] = previous
            if a.ab and B > 1:
                fns["qkv mkl-step"] = lambda x=x, m=ours: _without_packed_step(
                    lambda: generate(m, x, max_new_tokens=a.new, min_new_tokens=a.new))
            if a.ab_tiles and name == "bfloat16":
                fns["qkv bf16 before"] = lambda x=x, m=ours: _bf16_before(
                    lambda: generate(m, x, max_new_tokens=a.new, min_new_tokens=a.new))
                fns["qkv no fp16 step"] = lambda x=x, m=ours: _no_fp16_step(
                    lambda: generate(m, x, max_new_tokens=a.new, min_new_tokens=a.new))
            if a.ab_12g and name == "bfloat16":
                def before_12g(x=x, m=ours):
                    with previous_12g():
                        return generate(m, x, max_new_tokens=a.new, min_new_tokens=a.new)
                fns["qkv before 12g"] = before_12g
            with torch.no_grad():
                outs = {k: fn() for k, fn in fns.items()}  # warm-up, and the outputs compared
                times, _ = interleaved(fns, a.repeats)
            for k in fns:
                if k != "transformers":
                    same = (outs[k][:, a.prompt:] == outs["transformers"][:, a.prompt:]).float().mean().item()
                    agree[f"{name} batch {B}" + ("" if k == "qkv" else f" ({k})")] = round(same, 3)
            med = {k: statistics.median(v) for k, v in times.items()}
            for k in fns:
                ms = 1000 * med[k] / a.new
                rows.append({"dtype": name, "batch": B, "library": k, "ms_per_step": round(ms, 2),
                             "tok_per_s": round(B * a.new / med[k], 1), "vs_transformers": round(med["transformers"] / med[k], 3),
                             "floor_ms": round(floor_ms, 2), "x_floor": round(ms / floor_ms, 2)})

    prefill = []
    x = torch.randint(3, spec["vocab_size"], (1, a.prefill), generator=torch.Generator().manual_seed(7))
    for name in a.dtypes:
        hf, ours = models[name]
        fns = {"qkv": lambda m=ours: m(x, last_only=True),
               "transformers": lambda m=hf: m(x, logits_to_keep=1)}
        if a.ab_tiles and name == "bfloat16":
            fns["qkv bf16 before"] = lambda m=ours: _bf16_before(lambda: m(x, last_only=True))
        with torch.no_grad():
            for fn in fns.values():
                fn()
            times, _ = interleaved(fns, max(a.repeats, 3))
        med = {k: statistics.median(v) for k, v in times.items()}
        for k in fns:
            prefill.append({"dtype": name, "library": k, "tok_per_s": round(a.prefill / med[k], 1),
                            "vs_transformers": round(med["transformers"] / med[k], 3)})

    lines = [f"read bandwidth {gbps:.1f} GB/s; CPU {meta['cpu_capability']} (native bf16: {meta['native_bf16']}); "
             f"{a.threads} threads; prompt {a.prompt}, {a.new} new tokens (greedy), "
             f"median of {a.repeats} interleaved repeats", "",
             "| dtype | batch | library | ms/step | tok/s | x transformers | floor ms | x floor |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['batch']} | {r['library']} | {r['ms_per_step']} | {r['tok_per_s']} | "
              f"{r['vs_transformers']} | {r['floor_ms']} | {r['x_floor']} |" for r in rows]
    lines += ["", "greedy tokens equal between the libraries (share): " + ", ".join(f"{k}: {v}" for k, v in agree.items()),
              "", f"| dtype | library | prefill tok/s ({a.prefill} tokens) | x transformers |", "|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['library']} | {r['tok_per_s']} | {r['vs_transformers']} |" for r in prefill]
    lines += ["", "| load | weights MB | peak RSS growth MB | x weights |", "|---|---|---|---|"]
    lines += [f"| {k} ({d['dtype']}) | {d['weights'] / 1e6:.0f} | {(d['peak'] - d['before']) / 1e6:.0f} | {d['ratio']} |"
              for k, d in load.items()]
    table = "\n".join(lines)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "llm_quick" if a.quick else "llm"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "bandwidth_gbps": gbps, "decode": rows,
                                                  "token_agreement": agree, "prefill": prefill, "load": load}, indent=2))
    (out / f"{stem}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
