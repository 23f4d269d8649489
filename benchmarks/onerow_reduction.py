"""One-row weight products at batch 1: eager F.linear vs torch.compile of F.linear vs torch.compile of the
product written as a reduction, (w * x).sum(-1), vs Inductor's decompose_mm_pass (the compiler's own rewrite
of F.linear into that reduction), over 60 fp32 weights of 576 x 1536 (SmolLM-135M's MLP shape, 212 MB), in
one process, 9 interleaved rounds after the compile; GB/s = weight bytes / time. The question: does
Inductor's reduction stream the weights faster than torch's one-row GEMM on this CPU
(docs/performance.md)?

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/onerow_reduction.py [--threads 2] [--rounds 9]

Prints the compile times, the reduction's largest relative error, and best / median per variant.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def eager_linear(x: torch.Tensor, ws: list[torch.Tensor]) -> list[torch.Tensor]:
    return [F.linear(x, w) for w in ws]


def reductions(x: torch.Tensor, ws: list[torch.Tensor]) -> list[torch.Tensor]:
    return [(w * x).sum(-1) for w in ws]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--layers", type=int, default=60)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ws = [torch.randn(1536, 576) for _ in range(a.layers)]
    x = torch.randn(1, 576)
    variants = {"eager F.linear": eager_linear,
                "compiled F.linear": torch.compile(eager_linear, dynamic=False),
                "compiled (w*x).sum(-1)": torch.compile(reductions, dynamic=False),
                # Inductor's own rewrite of a one-row mm into a mul + sum (its CPU limit: sides <= 2048)
                "compiled F.linear, decompose_mm_pass": torch.compile(
                    eager_linear, dynamic=False,
                    options={"post_grad_fusion_options": {"decompose_mm_pass": {}}})}
    for name, fn in variants.items():
        t0 = time.perf_counter()
        fn(x, ws)
        print(f"first call (compile) {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    ref = torch.cat(eager_linear(x, ws), 1)
    got = torch.cat(variants["compiled (w*x).sum(-1)"](x, ws)).view(1, -1)
    print(f"reduction's largest relative error: {float((got - ref).abs().max() / ref.abs().max()):.1e}")
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(a.rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn(x, ws)
            times[name].append(time.perf_counter() - t0)
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    base_best, base_med = min(times["eager F.linear"]), statistics.median(times["eager F.linear"])
    for name, t in times.items():
        best, med = min(t), statistics.median(t)
        print(f"{name}: best {1000 * best:.1f} ms ({nbytes / best / 1e9:.1f} GB/s), "
              f"median {1000 * med:.1f} ms; speed vs eager: best {base_best / best:.2f}x, "
              f"median {base_med / med:.2f}x")


if __name__ == "__main__":
    main()
