"""The decoding step on a CPU at batch 1: eager vs the graph-captured step under several Inductor settings,
against the memory-bandwidth floor (the weights' bytes over a measured read bandwidth).

Model: benchmarks/llm.py's 135M Llama shape (width 576, 9 / 3 heads, MLP 1536, vocab 49152, tied), random
weights, --layers of them (default 30), loaded by qkv from a transformers folder. Each variant compiles its
own copy of the step (`model.static_step` over a static cache of 256 columns, what generate(compile=True)
runs); its first call (the compile) is timed apart. Then, in every one of --repeats interleaved rounds, each
variant runs --steps greedy steps after the same 16-token prefill; the table gives medians of ms/token, the
speed against eager (the median over rounds of eager's time / the variant's in the same round) and the
multiple of the floor. Variants:

  eager               model.step: torch's F.linear (aten::mm) for every product
  compiled            torch.compile, Inductor's defaults (the aten products stay)
  decompose_mm        + post_grad_fusion_options={"decompose_mm_pass": {}}: Inductor rewrites each one-row
                      product (both sides <= 2048) into a fused multiply + row sum
  cpp                 cpp_wrapper=True alone (the graph's kernel calls from C++, not Python)
  decompose_mm+cpp    both
  decompose_mm+freeze + freezing=True (weights folded in as constants)
  qkv default         what generate(compile=True) uses on this machine (generate/graphed.py)

Every variant's logits are compared with eager's (largest difference over the last step's logits, relative
to their largest magnitude). The machine may be shared: the rounds are interleaved, and ratios within one
run are what to compare.

    .venv/bin/python benchmarks/compiled_decode.py [--layers 30] [--threads 2]
        [--steps 32] [--repeats 5] [--dtype float32] [--quick]

--quick: 2 layers of width 64 (the smoke test). Writes OUT/compiled_decode.json and .md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

import qkv  # noqa: E402
from _timing import interleaved, write_results  # noqa: E402
from llm import FULL, QUICK, native_bf16, read_bandwidth  # noqa: E402
from qkv.generate.graphed import compiled_step  # noqa: E402

PROMPT, COLUMNS = 16, 256
DECOMPOSE = {"post_grad_fusion_options": {"decompose_mm_pass": {}}}
VARIANTS = {
    "compiled": {},
    "decompose_mm": DECOMPOSE,
    "cpp": {"cpp_wrapper": True},
    "decompose_mm+cpp": {**DECOMPOSE, "cpp_wrapper": True},
    "decompose_mm+freeze": {**DECOMPOSE, "freezing": True},
}


def build_model(spec: dict, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec, bos_token_id=1, eos_token_id=2))
    with tempfile.TemporaryDirectory(prefix="qkv-compiled-decode-") as tmp:
        hf.to(dtype).save_pretrained(tmp)
        return qkv.from_pretrained(tmp).eval()


def _step(model, ids, cache, index, n_pad, keep):  # generate/graphed.py's signature, no padding
    return model.static_step(ids, cache, index=index, offset=index)


def compiled(options: dict) -> Callable:
    """The static step compiled with these Inductor options, with a code object of its own (Dynamo keeps
    its graphs per code object)."""
    fn = types.FunctionType(_step.__code__.replace(), _step.__globals__, "_step")
    return torch.compile(fn, fullgraph=True, dynamic=False, options=options)


def run_steps(model, step: Callable | None, n: int, prompt: torch.Tensor) -> torch.Tensor:
    """Prefill `prompt` (eager), then n greedy steps through `step` (None: eager model.step). Returns the
    last step's logits."""
    cache = model.make_cache(1, COLUMNS)
    logits, _ = model.prefill(prompt, cache)
    ids = logits.argmax(-1, keepdim=True)
    index = torch.full((1,), cache.length, dtype=torch.long)
    for _ in range(n):
        if step is None:
            logits = model.step(ids, cache)
        else:
            logits = step(model, ids, cache, index, None, None)
            cache.advance(1)
            index.add_(1)
        ids = logits.argmax(-1, keepdim=True)
    return logits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--variants", nargs="+", default=[*VARIANTS, "qkv default"])
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args()
    if a.quick:
        a.steps, a.repeats = 4, 1
    torch.set_num_threads(a.threads)
    spec = dict(QUICK if a.quick else FULL)
    if not a.quick:
        spec["num_hidden_layers"] = a.layers
    dtype = getattr(torch, a.dtype)
    model = build_model(spec, dtype)
    prompt = torch.randint(3, spec["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(0))
    steps: dict[str, Callable | None] = {"eager": None}
    compile_s = {}
    with torch.inference_mode():
        ref = run_steps(model, None, a.steps, prompt)
        for name in a.variants:
            fn = compiled_step(model, True) if name == "qkv default" else compiled(VARIANTS[name])
            t0 = time.perf_counter()
            run_steps(model, fn, 1, prompt)
            compile_s[name] = round(time.perf_counter() - t0, 1)
            print(f"{name}: first step (compile) {compile_s[name]} s", flush=True)
            steps[name] = fn
        fns = {k: (lambda f=f: run_steps(model, f, a.steps, prompt)) for k, f in steps.items()}
        times, last = interleaved(fns, a.repeats)
    gbps = read_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    floor_ms = weight_bytes / (gbps * 1e9) * 1000
    scale = float(ref.abs().max())
    ms = {k: 1000 * statistics.median(t) / a.steps for k, t in times.items()}
    # the speed-up is paired round by round (eager's time / the variant's in the same round), then the median:
    # on a shared machine the load drifts between rounds more than variants differ within one
    paired = {k: statistics.median(e / t for e, t in zip(times["eager"], t_k, strict=True))
              for k, t_k in times.items()}
    rows = {k: {"ms_per_token": round(v, 2), "speed_vs_eager": round(paired[k], 3),
                "x_floor": round(v / floor_ms, 2), "compile_s": compile_s.get(k),
                "rel_diff": float((last[k] - ref).abs().max()) / scale,
                "ms_per_token_all": [round(1000 * t / a.steps, 2) for t in times[k]]}
            for k, v in ms.items()}
    meta = {"torch": torch.__version__, "threads": a.threads, "dtype": a.dtype,
            "layers": spec["num_hidden_layers"],
            "machine": platform.processor() or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": native_bf16(),
            "steps": a.steps, "repeats": a.repeats, "read_gbps": round(gbps, 1),
            "weight_mb": round(weight_bytes / 1e6, 2),
            "floor_ms": round(floor_ms, 2), "quick": a.quick,
            "note": "shared, loaded machine: medians of interleaved rounds; compare ratios within this run"}
    lines = [f"Decoding step, batch 1, {a.dtype}, {spec['num_hidden_layers']} layers "
             f"({weight_bytes / 1e6:.1f} MB of weights), {a.threads} threads, {meta['cpu_capability']}; "
             f"floor {floor_ms:.1f} ms at {gbps:.1f} GB/s; medians of {a.repeats} interleaved rounds of "
             f"{a.steps} steps", "",
             "| variant | ms/token | x eager speed | x floor | compile s | max rel. diff vs eager |",
             "|---|---|---|---|---|---|"]
    for k, r in rows.items():
        lines.append(f"| {k} | {r['ms_per_token']:.1f} | {r['speed_vs_eager']:.2f} | {r['x_floor']:.2f} | "
                     f"{r['compile_s'] if r['compile_s'] is not None else '-'} | {r['rel_diff']:.1e} |")
    stem = "compiled_decode_quick" if a.quick else f"compiled_decode_{a.dtype}_{spec['num_hidden_layers']}l"
    write_results(a.out, stem, {"meta": meta, "rows": rows}, lines)


if __name__ == "__main__":
    main()
