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

    .venv/bin/python benchmarks/llm.py [--quick] [--threads 2] [--new 256] [--repeats 3] [--no-compile]
        [--no-int8]

Rows: "qkv" (eager), "qkv compiled" (GenerationConfig(compile=True): the decoding step through torch.compile,
compile time excluded: each configuration is warmed up first), "qkv int8" (weight-only int8, where
qkv.from_pretrained(..., quantize="int8") exists), "transformers".

--quick: a 2-layer model of width 64, bf16 only, batch 1, 8 tokens (the smoke test,
tests/benchmarks/test_benchmark_llm.py). Writes benchmarks/results/llm.json and llm.md.
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

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

import qkv  # noqa: E402
from _timing import interleaved  # noqa: E402
from qkv.generate import generate  # noqa: E402

FULL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=10000.0)
QUICK = dict(FULL, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)

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


def native_bf16() -> bool:
    """Does this CPU multiply bf16 natively (AVX512-BF16 or AMX)? Reported, never acted on."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decoding step reads: the state dict's tensors (a tied weight once; int8 weights
    with their scales), not the non-persistent tables (RoPE's cos/sin, masks) of which a step reads one
    row."""
    tensors = model.state_dict(keep_vars=True).values()
    seen = {t.data_ptr(): t for t in tensors if t.is_floating_point() or t.dtype == torch.int8}
    return sum(t.numel() * t.element_size() for t in seen.values())


def _load_int8(folder: Path):
    """qkv's weight-only int8 model of `folder`, or None where this qkv has no quantize= argument."""
    try:
        return qkv.from_pretrained(folder, quantize="int8")
    except TypeError:
        return None


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
    ap.add_argument("--no-compile", action="store_true", help="skip the 'qkv compiled' rows")
    ap.add_argument("--no-int8", action="store_true", help="skip the 'qkv int8' rows")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args()
    if a.quick:
        a.new, a.repeats, a.prefill, a.batches, a.dtypes = 8, 1, 32, [1], ["bfloat16"]
    torch.set_num_threads(a.threads)
    import transformers

    spec = QUICK if a.quick else FULL
    torch.manual_seed(0)
    hf32 = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec, bos_token_id=1,
                                                                  eos_token_id=2)).eval()
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
            "native_bf16": native_bf16(),
            "prompt": a.prompt, "new_tokens": a.new, "prefill": a.prefill, "repeats": a.repeats,
            "note": "shared, loaded machine: medians of interleaved repeats; compare ratios within this run"}

    # quick: the probe runs, the figure means nothing
    libraries = ("qkv",) if a.quick else ("qkv", "transformers")
    load = {f"{lib} {name}": load_peak(folders[name], lib) for name in a.dtypes for lib in libraries}
    gbps = read_bandwidth()

    rows, agree = [], {}
    # int8 from the bf16 folder: torch's fused int8 kernel takes bf16 activations (fp32 ones take a slow loop)
    source = folders.get("bfloat16", folders.get("float32"))
    int8 = None if a.no_int8 else _load_int8(source)
    for name in a.dtypes:
        hf, ours = models[name]
        weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
        floor_ms = weight_bytes / (gbps * 1e9) * 1000
        int8_floor_ms = None if int8 is None else model_bytes(int8) / (gbps * 1e9) * 1000
        for B in a.batches:
            x = torch.randint(3, spec["vocab_size"], (B, a.prompt),
                              generator=torch.Generator().manual_seed(B))
            fns = {
                "qkv": lambda x=x, m=ours: generate(m, x, max_new_tokens=a.new, min_new_tokens=a.new),
                "transformers": lambda x=x, m=hf: m.generate(x, attention_mask=torch.ones_like(x),
                                                             max_new_tokens=a.new,
                                                             min_new_tokens=a.new, do_sample=False,
                                                             pad_token_id=0),
            }
            if not a.no_compile:
                fns["qkv compiled"] = lambda x=x, m=ours: generate(m, x, max_new_tokens=a.new,
                                                                   min_new_tokens=a.new, compile=True)
            if int8 is not None and folders[name] == source:
                fns["qkv int8"] = lambda x=x, m=int8: generate(m, x, max_new_tokens=a.new,
                                                               min_new_tokens=a.new)
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
                floor = int8_floor_ms if k == "qkv int8" else floor_ms
                rows.append({"dtype": "int8" if k == "qkv int8" else name, "batch": B, "library": k,
                             "ms_per_step": round(ms, 2), "tok_per_s": round(B * a.new / med[k], 1),
                             "vs_transformers": round(med["transformers"] / med[k], 3),
                             "floor_ms": round(floor, 2), "x_floor": round(ms / floor, 2)})

    prefill = []
    x = torch.randint(3, spec["vocab_size"], (1, a.prefill), generator=torch.Generator().manual_seed(7))
    for name in a.dtypes:
        hf, ours = models[name]
        fns = {"qkv": lambda m=ours: m(x, last_only=True),
               "transformers": lambda m=hf: m(x, logits_to_keep=1)}
        with torch.no_grad():
            for fn in fns.values():
                fn()
            times, _ = interleaved(fns, max(a.repeats, 3))
        med = {k: statistics.median(v) for k, v in times.items()}
        for k in fns:
            prefill.append({"dtype": name, "library": k, "tok_per_s": round(a.prefill / med[k], 1),
                            "vs_transformers": round(med["transformers"] / med[k], 3)})

    lines = [f"read bandwidth {gbps:.1f} GB/s; CPU {meta['cpu_capability']} (native bf16: "
             f"{meta['native_bf16']}); {a.threads} threads; prompt {a.prompt}, {a.new} new tokens (greedy), "
             f"median of {a.repeats} interleaved repeats", "",
             "| dtype | batch | library | ms/step | tok/s | x transformers | floor ms | x floor |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['batch']} | {r['library']} | {r['ms_per_step']} | {r['tok_per_s']} | "
              f"{r['vs_transformers']} | {r['floor_ms']} | {r['x_floor']} |" for r in rows]
    lines += ["",
              "greedy tokens equal between the libraries (share): "
              + ", ".join(f"{k}: {v}" for k, v in agree.items()),
              "", f"| dtype | library | prefill tok/s ({a.prefill} tokens) | x transformers |",
              "|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['library']} | {r['tok_per_s']} | {r['vs_transformers']} |"
                  for r in prefill]
    lines += ["", "| load | weights MB | peak RSS growth MB | x weights |", "|---|---|---|---|"]
    lines += [f"| {k} ({d['dtype']}) | {d['weights'] / 1e6:.0f} | {(d['peak'] - d['before']) / 1e6:.0f} | "
              f"{d['ratio']} |"
              for k, d in load.items()]
    table = "\n".join(lines)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "llm_quick" if a.quick else "llm"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "bandwidth_gbps": gbps, "decode": rows,
                                                  "token_agreement": agree, "prefill": prefill, "load": load},
                                                 indent=2))
    (out / f"{stem}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
