"""The linear products of a decoding step by number of rows (batch size), through each path Linear.step can take,
on the 135M-class Llama's shapes (issue 12: batch 8 cost 2.2x batch 1 though it streams the same weights).

Paths, all computing y = x W^T (+ b) in fp32 on CPU:
  F.linear     MKL sgemm on the (out, in) weight (what transformers runs)
  transposed   addmm/mm on the pre-transposed (in, out) copy (Linear.step's one-row path)
  packed       oneDNN's inner product on a copy packed by oneDNN (`torch.ops.mkldnn._reorder_linear_weight`; Linear.step's
               path from qkv.nn.linear.STEP_PACKED_MIN_ROWS rows)
Per layer shape (fused q/k/v 576->960, o 576->576, gate and up 576->1536, down 1536->576) `--layers` distinct weight
matrices are multiplied in turn, so the weights stream from memory as in a real step; the (49152 x 576) output head is
one matrix. Reported: ms per product (medians of `--repeats` interleaved rounds, paths round robin), GB/s of weights
read, and the per-step sum over 30 layers + head for each path. The machine is shared: compare within the run.

    .venv/bin/python benchmarks/step_rows.py [--quick] [--threads 2] [--rows 1 2 4 8 16] [--repeats 5]

--quick: small shapes, 2 layers, one round (the smoke test, tests/test_benchmark_step_rows.py).
Writes OUT/step_rows.json and step_rows.md (OUT = benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
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

from _timing import interleaved  # noqa: E402
from qkv.nn.linear import onednn_packable  # noqa: E402

# name: (in, out, products of that shape per layer)
FULL = {"qkv": (576, 960, 1), "o": (576, 576, 1), "gate/up": (576, 1536, 2), "down": (1536, 576, 1),
        "head": (576, 49152, 0)}
QUICK = {"qkv": (64, 128, 1), "o": (64, 64, 1), "gate/up": (64, 128, 2), "down": (128, 64, 1), "head": (64, 512, 0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args()
    shapes = QUICK if a.quick else FULL
    if a.quick:
        a.rows, a.layers, a.repeats = [1, 8], 2, 1
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    paths = ["F.linear", "transposed"] + (["packed"] if onednn_packable() else [])
    rows_out, per_step = [], {}
    for name, (i, o, per_layer) in shapes.items():
        n = 1 if per_layer == 0 else a.layers
        ws = [torch.randn(o, i) for _ in range(n)]
        wts = [w.t().contiguous() for w in ws]
        wps = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in ws] if "packed" in paths else []
        for m in a.rows:
            x = torch.randn(m, i)
            fns = {"F.linear": lambda x=x, ws=ws: [F.linear(x, w) for w in ws],
                   "transposed": lambda x=x, wts=wts: [torch.mm(x, w) for w in wts],
                   "packed": lambda x=x, wps=wps: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                                   for w in wps]}
            fns = {k: fns[k] for k in paths}
            ref = F.linear(x, ws[0])
            err = {k: (fns[k]()[0] - ref).abs().max().item() for k in fns}  # warm-up, and the same function
            times, _ = interleaved(fns, a.repeats)
            gb = sum(w.numel() * 4 for w in ws) / 1e9
            for k, v in times.items():
                med = statistics.median(v)
                ms = 1000 * med / n
                rows_out.append({"shape": name, "in": i, "out": o, "rows": m, "path": k, "ms": round(ms, 4),
                                 "gbps": round(gb / med, 2), "max_abs_err": err[k]})
                count = 1 if per_layer == 0 else per_layer * 30
                per_step[(m, k)] = per_step.get((m, k), 0.0) + ms * count
    meta = {"torch": torch.__version__, "threads": a.threads, "machine": platform.processor() or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "layers": a.layers, "repeats": a.repeats,
            "quick": a.quick, "note": "shared machine: medians of interleaved rounds; compare within this run"}
    lines = [f"{a.threads} threads, {meta['cpu_capability']}; ms per product, median of {a.repeats} interleaved rounds "
             f"({a.layers} distinct weights per shape, streamed)", "",
             "| shape (in x out) | rows | " + " | ".join(f"{p} ms (GB/s)" for p in paths) + " |",
             "|---|---|" + "---|" * len(paths)]
    for name, (i, o, _) in shapes.items():
        for m in a.rows:
            cells = [next(r for r in rows_out if r["shape"] == name and r["rows"] == m and r["path"] == p) for p in paths]
            lines.append(f"| {name} ({i} x {o}) | {m} | " + " | ".join(f"{c['ms']:.3f} ({c['gbps']})" for c in cells) + " |")
    lines += ["", "Linear products of one decoding step (30 layers + head), ms:", "",
              "| rows | " + " | ".join(paths) + " |", "|---|" + "---|" * len(paths)]
    lines += [f"| {m} | " + " | ".join(f"{per_step[(m, p)]:.1f}" for p in paths) + " |" for m in a.rows]
    table = "\n".join(lines)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "step_rows_quick" if a.quick else "step_rows"
    step = [{"rows": m, "path": p, "ms": round(v, 2)} for (m, p), v in per_step.items()]
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "products": rows_out, "step": step}, indent=2))
    (out / f"{stem}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
