"""bf16 kernel routes on a CPU without native bf16 (issue 12): qkv's bf16 paths against the bf16 ops they replace,
on the 135M Llama's shapes, side by side in interleaved rounds (A B A B ..., medians).

  linear     the weights of every layer (q/k/v, o, gate, up, down; 30 layers, random bf16, more bytes than the caches,
             so they are read from memory as in a decoding step) and the tied (49152 x 576) output head, multiplied
             by R rows: F.linear (torch's bf16 kernel) vs qkv.nn.linear.bf16_tiled_linear (fp32 tiles of the weight)
  attention  a decoding step's attention products of one layer, (B * 3 kv heads) x (3 query heads) over Tk cached keys:
             bf16 bmm + softmax + bmm vs qkv.nn.attention._bf16_step_products (the products on fp32 copies)
  linear fp16 step  the same weights multiplied by 1, 2 or 8 rows: F.linear vs Linear.step's fp16 copy (fbgemm's fp16
             GEMM, qkv.nn.linear.STEP_BF16_VIA_FP16; docs/perf/bf16_12e.md), where this torch has fbgemm
  rmsnorm    one bf16 row of width 576: RMSNorm.forward vs RMSNorm.step
Every route is checked against the one it replaces (max |difference| in the table). The machine may be shared: compare
ratios within one run.

    .venv/bin/python benchmarks/bf16_routes.py [--threads 2] [--rounds 7] [--quick]

--quick: 2 layers of width 64, a few rounds (the smoke test, tests/test_bf16_routes_bench.py). Writes OUT/bf16_routes.json
and .md (OUT = benchmarks/results).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/generate.py

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from _timing import interleaved, write_results  # noqa: E402
from qkv.nn import attention, linear  # noqa: E402
from qkv.nn.norm import RMSNorm  # noqa: E402

FULL = dict(layers=30, d=576, ff=1536, heads=9, kv=3, vocab=49152, rows=(1, 4, 8, 32), attn=((1, 160), (8, 160), (8, 288)))
QUICK = dict(layers=2, d=64, ff=128, heads=4, kv=2, vocab=512, rows=(1, 8), attn=((2, 16),))


def linear_cases(s: dict) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    hd = s["d"] // s["heads"]
    shapes = [(s["d"] + 2 * s["kv"] * hd, s["d"]), (s["d"], s["d"]), (s["ff"], s["d"]), (s["ff"], s["d"]), (s["d"], s["ff"])]
    layers = [[(torch.randn(*sh, generator=g) * 0.05).bfloat16() for sh in shapes] for _ in range(s["layers"])]
    head = (torch.randn(s["vocab"], s["d"], generator=g) * 0.05).bfloat16()
    rows_out = []
    for R in s["rows"]:
        xs = {n: torch.randn(R, n, generator=g).bfloat16() for n in (s["d"], s["ff"])}

        def run(fn, what, xs=xs):
            if what == "head":
                return lambda: fn(xs[s["d"]], head)
            return lambda: [fn(xs[w.shape[1]], w) for ws in layers for w in ws]

        for what in ("layers", "head"):
            fns = {"F.linear": run(F.linear, what), "fp32 tiles": run(linear.bf16_tiled_linear, what)}
            with torch.no_grad():
                a, b = fns["F.linear"](), fns["fp32 tiles"]()
                a, b = (a, b) if what == "head" else (torch.cat([t.flatten() for t in a]), torch.cat([t.flatten() for t in b]))
            rows_out.append(_route_row("linear", f"{what}, {R} rows", fns, s["rounds"], a, b))
    return rows_out


def _route_row(bench: str, case: str, fns: dict, rounds: int, a: torch.Tensor, b: torch.Tensor) -> dict:
    """One table row: fns (the bf16 op first, qkv's route second) timed interleaved; a, b their outputs."""
    before, route = fns
    with torch.no_grad():
        times, _ = interleaved(fns, rounds)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"bench": bench, "case": case, "before_ms": round(med[before], 3), "qkv_ms": round(med[route], 3),
            "speedup": round(med[before] / med[route], 2), "max_abs_diff": (a.float() - b.float()).abs().max().item()}


def fp16_step_cases(s: dict) -> list[dict]:
    """The step's products of few rows: F.linear vs Linear.step's fp16 copy (linear.STEP_BF16_VIA_FP16), the same
    weights as linear_cases (a Linear per weight; the copies are made before timing)."""
    if not linear.fp16_packable() or linear.native_bf16():
        return []
    g = torch.Generator().manual_seed(0)
    hd = s["d"] // s["heads"]
    shapes = [(s["d"] + 2 * s["kv"] * hd, s["d"]), (s["d"], s["d"]), (s["ff"], s["d"]), (s["ff"], s["d"]), (s["d"], s["ff"])]

    def lin(out: int, inp: int) -> linear.Linear:
        m = linear.Linear(inp, out, bias=False).bfloat16().requires_grad_(False)
        m.weight.copy_((torch.randn(out, inp, generator=g) * 0.05).bfloat16())
        return m

    layers = [lin(*sh) for _ in range(s["layers"]) for sh in shapes]
    head = lin(s["vocab"], s["d"])
    out = []
    # the route itself, even for --quick's layers and for one row (where qkv's step keeps F.linear: STEP_FP16_MIN_ROWS)
    old = linear.STEP_FP16_MIN_WEIGHT, linear.STEP_FP16_MIN_ROWS
    linear.STEP_FP16_MIN_WEIGHT, linear.STEP_FP16_MIN_ROWS = 0, 1
    try:
        _fp16_rows(s, layers, head, g, out)
    finally:
        linear.STEP_FP16_MIN_WEIGHT, linear.STEP_FP16_MIN_ROWS = old
    return out


def _fp16_rows(s: dict, layers: list, head: linear.Linear, g: torch.Generator, out: list) -> None:
    """fp16_step_cases' rows (1, 2 and 8 rows; the layers, the head) appended to out."""
    for R in (1, 2, 8):
        xs = {n: torch.randn(R, n, generator=g).bfloat16() for n in (s["d"], s["ff"])}
        for what, mods in (("layers", layers), ("head", [head])):
            fns = {"F.linear": lambda mods=mods, xs=xs: [F.linear(xs[m.in_features], m.weight) for m in mods],
                   "fp16 step": lambda mods=mods, xs=xs: [m.step(xs[m.in_features]) for m in mods]}
            with torch.no_grad():
                a, b = (torch.cat([t.flatten() for t in fn()]) for fn in fns.values())  # also makes the copies
            out.append(_route_row("linear fp16 step", f"{what}, {R} rows", fns, s["rounds"], a, b))


def _attention_fns(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, Tk: int, hd: int) -> dict:
    def bf16_bmm():
        scores = torch.bmm(q, k.reshape(n, Tk, hd).transpose(1, 2))
        return torch.bmm(torch.softmax(scores, -1), v.reshape(n, Tk, hd))

    return {"bf16 bmm": bf16_bmm, "fp32 products": lambda: attention._bf16_step_products(q, k, v, None, n, Tk, hd)}


def attention_cases(s: dict) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    hd, G = s["d"] // s["heads"], s["heads"] // s["kv"]
    out = []
    for B, Tk in s["attn"]:
        n = B * s["kv"]
        q = torch.randn(n, G, hd, generator=g).bfloat16()
        k = torch.randn(B, s["kv"], Tk + 8, hd, generator=g).bfloat16()[:, :, :Tk]  # views of a longer cache
        v = torch.randn(B, s["kv"], Tk + 8, hd, generator=g).bfloat16()[:, :, :Tk]

        fns = _attention_fns(q, k, v, n, Tk, hd)
        diff = (fns["bf16 bmm"]().float() - fns["fp32 products"]().float()).abs().max().item()
        times, _ = interleaved(fns, s["rounds"] * 20)
        med = {k_: statistics.median(t) * 1e6 for k_, t in times.items()}
        out.append({"bench": "attention", "case": f"batch {B}, {Tk} keys (one layer)", "before_ms": round(med["bf16 bmm"] / 1e3, 4),
                    "qkv_ms": round(med["fp32 products"] / 1e3, 4), "speedup": round(med["bf16 bmm"] / med["fp32 products"], 2),
                    "max_abs_diff": diff})
    return out


def rmsnorm_case(s: dict) -> list[dict]:
    norm = RMSNorm(s["d"], 1e-5).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(s["d"], generator=torch.Generator().manual_seed(2)))
        x = torch.randn(1, s["d"]).bfloat16()
        fns = {"forward": lambda: norm(x), "step": lambda: norm.step(x)}
        diff = (fns["forward"]().float() - fns["step"]().float()).abs().max().item()
        times, _ = interleaved(fns, s["rounds"] * 200)
    med = {k: statistics.median(t) * 1e3 for k, t in times.items()}
    return [{"bench": "rmsnorm", "case": f"one row of {s['d']}", "before_ms": round(med["forward"], 4),
             "qkv_ms": round(med["step"], 4), "speedup": round(med["forward"] / med["step"], 2), "max_abs_diff": diff}]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    s = dict(QUICK if a.quick else FULL, rounds=1 if a.quick else a.rounds)
    rows = linear_cases(s) + fp16_step_cases(s) + attention_cases(s) + rmsnorm_case(s)
    cpu = torch.backends.cpu.get_cpu_capability()
    head = (f"CPU {cpu} (native bf16: {linear.native_bf16()}), {platform.machine()}, torch {torch.__version__}, "
            f"{a.threads} threads, median of {s['rounds']} interleaved rounds (x20 attention, x200 rmsnorm); bf16 weights "
            f"and results in both columns; max |diff| = the largest difference between the two results")
    lines = [head, "", "| bench | case | bf16 op ms | qkv route ms | speedup | max abs diff |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['bench']} | {r['case']} | {r['before_ms']} | {r['qkv_ms']} | {r['speedup']} | {r['max_abs_diff']:.3g} |"
              for r in rows]
    result = {"cpu_capability": cpu, "native_bf16": linear.native_bf16(), "threads": a.threads, "rounds": s["rounds"],
              "torch": torch.__version__, "quick": a.quick, "rows": rows}
    write_results(a.out, "bf16_routes_quick" if a.quick else "bf16_routes", result, lines)
    return result


if __name__ == "__main__":
    main()
