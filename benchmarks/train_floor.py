"""How far can qkv's fp32 training step get below nanoGPT's? The step's own GEMM and attention kernels, replayed
alone, against the whole steps, in one process (issue 15's CPU bar: qkv >= 1.1x nanoGPT's model.py).

The work is benchmarks/train_vs_nanogpt.py's: GPT 6L/6H/384, block 256, batch 8, vocab 65, fp32, forward + loss +
backward + torch's default AdamW (on CPU the per-parameter loop) + zero_grad, the same weights and batches.
nanoGPT's model.py is passed with --nanogpt (never shipped).

1. Record. One step of each model runs under a TorchDispatchMode that keeps every call of the matrix products
   (aten mm / addmm / bmm / baddbmm) and of the attention kernels (aten._scaled_dot_product_*), with the very
   tensors they were called with (their shapes, strides, transposed views and values). The two lists are
   compared: the same multiset of (op, shapes, strides) means both steps run the same GEMMs and attention.
2. Time, interleaved (A B C .., reversed every other round): the whole qkv step, nanoGPT's step, qkv with the
   exact GELU (nanoGPT's function), the recorded GEMMs replayed alone (same calls, same arguments), the recorded
   attention kernels replayed alone, a 2048^3 sgemm (the machine's GEMM rate under the same load), and the
   candidates of the issue as A/Bs on the step's own shapes: SDPA flash vs the math backend (forward +
   backward of the model's attention), GELU tanh vs exact (forward + backward), and the whole qkv step with the
   math SDPA backend.
3. The floor. GEMMs + attention kernels (as torch runs them) is what any step with this work pays unless it
   computes those products faster than torch does; what is left over in a step ("the rest": norms,
   activations, residual adds, the loss, the embeddings, AdamW, autograd) is all a change around the kernels
   can cut. Reported per round: floor / step, and the largest speedup over nanoGPT's step a qkv step could
   reach with the rest at zero (nanoGPT step / floor).

    .venv/bin/python benchmarks/train_floor.py --nanogpt PATH/model.py [--rounds 10] [--quick]

Writes OUT/train_floor[_quick].json and .md (OUT = benchmarks/results).
"""

from __future__ import annotations

import argparse
import collections
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
import train_vs_nanogpt as tv  # noqa: E402
from _timing import write_results  # noqa: E402

aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
# the CPU attention kernels (flash forward / backward; the math backend decomposes into bmm + softmax instead)
ATTENTION_PREFIX = "aten::_scaled_dot_product"


class Recorder(TorchDispatchMode):
    """Keeps (op, args, kwargs) of every GEMM and attention-kernel call made while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.gemms: list[tuple] = []
        self.attention: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GEMMS or func.name().startswith(ATTENTION_PREFIX):
            # detached aliases (no copy): the replay is no autograd work
            keep = (func, *[tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in args),
                            {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}])
            (self.gemms if func in GEMMS else self.attention).append(keep)
        return func(*args, **kwargs)


class KernelClock(TorchDispatchMode):
    """Sums the wall time of the GEMM and attention-kernel calls of a step as they run inside it (warm caches,
    the step's own allocation pattern), to set against the step's time. The mode's own dispatch cost
    (a Python call per aten op) lands in the step's time, not in the kernels'."""

    def __init__(self) -> None:
        super().__init__()
        self.gemm = self.attention = self.cpu = 0.0  # wall s of each kind; process CPU s of both

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        gemm = func in GEMMS
        if not (gemm or func.name().startswith(ATTENTION_PREFIX)):
            return func(*args, **kwargs)
        t0, c0 = time.perf_counter(), time.process_time()
        out = func(*args, **kwargs)
        dt = time.perf_counter() - t0
        self.cpu += time.process_time() - c0
        if gemm:
            self.gemm += dt
        else:
            self.attention += dt
        return out


def clocked(step, x: torch.Tensor, into: list[float], into_cpu: list[float]):
    """A contender: one step under KernelClock; appends the kernels' wall and CPU seconds to the lists."""
    def run() -> None:
        clock = KernelClock()
        with clock:
            step(x)
        into.append(clock.gemm + clock.attention)
        into_cpu.append(clock.cpu)
    return run


def signature(call: tuple) -> tuple:
    """(op, shapes and strides of the tensor arguments, the other arguments): what decides a kernel's work."""
    func, args, kwargs = call
    q = args[0]
    if "scale" in kwargs and isinstance(q, torch.Tensor) and abs(kwargs["scale"] - q.shape[-1] ** -0.5) < 1e-12:
        kwargs = {k: v for k, v in kwargs.items() if k != "scale"}  # the default scale, given explicitly (qkv)

    def one(a):
        return ("T", tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a
    return (func.name(), tuple(one(a) for a in args), tuple(sorted((k, one(v)) for k, v in kwargs.items())))


def gemm_flops(call: tuple) -> int:
    """2 m k n (times the batch for bmm)."""
    func, args, _ = call
    a, b = (args[1], args[2]) if func in (aten.addmm.default, aten.baddbmm.default) else (args[0], args[1])
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


def attention_flops(s: dict) -> int:
    """Causal attention's useful multiply-adds over the whole step: the forward's two products (q k^T and p v)
    over the T(T+1)/2 visible pairs, the backward's four (no recomputation counted): 3x the forward."""
    pairs = s["block"] * (s["block"] + 1) // 2
    fwd = 2 * 2 * s["batch"] * s["n_embd"] * pairs  # heads x head_dim = n_embd
    return 3 * fwd * s["n_layer"]


def replay(calls: list[tuple]):
    def run() -> None:
        with torch.no_grad():
            for func, args, kwargs in calls:
                func(*args, **kwargs)
    return run


def record(step, x: torch.Tensor) -> Recorder:
    rec = Recorder()
    with rec:
        step(x)
    return rec


def attention_ab(s: dict):
    """forward + backward of the model's causal attention: q, k, v are views of one (B, T, 3d) projection output,
    as in both models; the output re-assembled to (B, T, d). Returns {backend: fn} over all n_layer layers."""
    B, T, d, H = s["batch"], s["block"], s["n_embd"], s["n_head"]
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(B, T, 3 * d, generator=g).requires_grad_()
    dy = torch.randn(B, T, d, generator=g)

    def layer(backend: SDPBackend) -> None:
        q, k, v = (t.view(B, T, H, d // H).transpose(1, 2) for t in qkv.split(d, dim=2))
        with sdpa_kernel(backend):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y.transpose(1, 2).reshape(B, T, d).backward(dy)
        qkv.grad = None

    def make(backend: SDPBackend):
        return lambda: [layer(backend) for _ in range(s["n_layer"])]

    return {"attention fwd+bwd, flash": make(SDPBackend.FLASH_ATTENTION),
            "attention fwd+bwd, math": make(SDPBackend.MATH)}


class SigmoidGeluTanh(torch.autograd.Function):
    """A candidate measured here, not used by qkv: GPT-2's tanh GELU written as x * sigmoid(2z),
    z = sqrt(2/pi) (x + 0.044715 x^3) (0.5 (1 + tanh z) = sigmoid(2z): the same function up to fp32 rounding),
    four elementwise passes whose sigmoid (an exp) is cheaper here than torch's one-pass tanh kernel. It saves
    sigmoid(2z) for the backward next to x: one (N, d_ff) tensor per layer more than F.gelu keeps."""

    @staticmethod
    def _sigmoid_2z(x: torch.Tensor) -> torch.Tensor:
        c = (2 / torch.pi) ** 0.5
        return torch.addcmul(torch.full((), 2 * c, dtype=x.dtype), x, x, value=2 * c * 0.044715).mul_(x).sigmoid_()

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        s = SigmoidGeluTanh._sigmoid_2z(x)
        ctx.save_for_backward(x, s)
        return s * x

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        x, s = ctx.saved_tensors
        c = (2 / torch.pi) ** 0.5
        d = torch.addcmul(torch.full((), 2 * c, dtype=x.dtype), x, x, value=6 * c * 0.044715).mul_(x)  # x d(2z)/dx
        return d.mul_(torch.addcmul(s, s, s, value=-1)).add_(s).mul_(g)  # (s + x s (1 - s) d(2z)/dx) g


def gelu_ab(s: dict):
    """forward + backward of the FFN activation on its (B*T, 4d) input, all n_layer layers."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(s["batch"] * s["block"], 4 * s["n_embd"], generator=g).requires_grad_()
    dy = torch.randn(h.shape, generator=g)

    def make(approximate: str):
        def run() -> None:
            for _ in range(s["n_layer"]):
                F.gelu(h, approximate=approximate).backward(dy)
                h.grad = None
        return run

    def sigmoid_form() -> None:
        for _ in range(s["n_layer"]):
            SigmoidGeluTanh.apply(h).backward(dy)
            h.grad = None

    return {"GELU fwd+bwd, tanh (qkv's GPT-2)": make("tanh"), "GELU fwd+bwd, exact (nanoGPT's)": make("none"),
            "GELU fwd+bwd, tanh as x*sigmoid(2z) (candidate)": sigmoid_form}


def med_ratio(num: list[float], den: list[float]) -> dict:
    r = [n / d for n, d in zip(num, den)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanogpt", required=True, metavar="PATH", help="path of nanoGPT's model.py (not shipped)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny models, 2 rounds (the smoke test)")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args(argv)
    s = tv.QUICK if a.quick else tv.FULL
    if a.quick:
        a.rounds, a.threads = 2, 1
    torch.set_num_threads(a.threads)
    nanogpt = tv.load_nanogpt(a.nanogpt)
    ours, nano, _, exact, _ = tv.build_models(nanogpt, s)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, s["vocab"], (s["batch"], s["block"]), generator=g) for _ in range(2)]
    steps = {"qkv step": tv.make_step("qkv GPT", ours, "fp32"),
             "nanoGPT step": tv.make_step("nanoGPT GPT", nano, "fp32"),
             "qkv step, exact GELU": tv.make_step("qkv GPT, exact GELU", exact, "fp32")}
    math_model = tv.make_step("qkv GPT", ours, "fp32")  # the same model, its own AdamW: the SDPA backend A/B

    def qkv_math(x):
        with sdpa_kernel(SDPBackend.MATH):
            return math_model(x)

    losses = {k: f(batches[0]) for k, f in steps.items()}
    losses["qkv step, SDPA math"] = qkv_math(batches[0])  # one update later than "qkv step": not compared
    recs = {k: record(steps[k], batches[1]) for k in ("qkv step", "nanoGPT step")}
    sig = {k: collections.Counter(map(signature, r.gemms + r.attention)) for k, r in recs.items()}
    same_kernels = sig["qkv step"] == sig["nanoGPT step"]
    rec = recs["qkv step"]
    n = 256 if a.quick else 2048
    sq = (torch.randn(n, n, generator=g), torch.randn(n, n, generator=g))
    inside: dict[str, list[float]] = {"qkv": [], "nanoGPT": []}  # kernel seconds inside the clocked steps
    inside_cpu: dict[str, list[float]] = {"qkv": [], "nanoGPT": []}  # the same in process CPU seconds
    fns = {**{k: (lambda f=f: f(batches[1])) for k, f in steps.items()},
           "qkv step, kernels clocked": clocked(steps["qkv step"], batches[1], inside["qkv"], inside_cpu["qkv"]),
           "nanoGPT step, kernels clocked": clocked(steps["nanoGPT step"], batches[1], inside["nanoGPT"],
                                                      inside_cpu["nanoGPT"]),
           "qkv step, SDPA math": lambda: qkv_math(batches[1]),
           "the step's GEMMs alone": replay(rec.gemms),
           "the step's attention kernels alone": replay(rec.attention),
           f"sgemm {n}^3": lambda: torch.mm(*sq),
           **attention_ab(s), **gelu_ab(s)}
    for f in fns.values():  # warm-up
        f()
    for v in (*inside.values(), *inside_cpu.values()):
        v.clear()
    times: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}  # process CPU time: less moved by other jobs than wall time
    order = list(fns)
    for r in range(a.rounds):
        for k in (order if r % 2 == 0 else order[::-1]):
            t0, c0 = time.perf_counter(), time.process_time()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
        print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{k} {1e3 * times[k][-1]:.0f}" for k in order) + " ms",
              flush=True)

    gflop_gemm = sum(map(gemm_flops, rec.gemms)) / 1e9
    gflop_attn = attention_flops(s) / 1e9
    # the floor, two ways: the kernels' time inside the (clocked) steps, and the kernels replayed alone (cold caches)
    floor = inside["qkv"]
    replayed = [gm + at for gm, at in zip(times["the step's GEMMs alone"], times["the step's attention kernels alone"])]
    med = {k: statistics.median(v) for k, v in times.items()}
    nano_t, qkv_t = times["nanoGPT step"], times["qkv step"]
    rest_q = [q - f for q, f in zip(qkv_t, floor)]
    target_cut = [q - nt / tv.BAR for q, nt in zip(qkv_t, nano_t)]  # what qkv must save to reach the bar
    result = {
        "benchmark": "train_floor", "quick": a.quick, "config": s, "rounds": a.rounds, "threads": a.threads,
        "fp32_first_step_loss": {k: v for k, v in losses.items() if k != "qkv step, SDPA math"},
        "same_gemm_and_attention_calls": same_kernels,
        "calls": {"gemm": len(rec.gemms), "attention": len(rec.attention),
                  "gemm_nanogpt": len(recs["nanoGPT step"].gemms),
                  "attention_nanogpt": len(recs["nanoGPT step"].attention)},
        "gflop": {"gemm": gflop_gemm, "attention_causal": gflop_attn},
        "median_ms": {k: 1e3 * v for k, v in med.items()},
        "median_cpu_ms": {k: 1e3 * statistics.median(v) for k, v in cpu.items()},
        "per_round_ms": {k: [1e3 * t for t in v] for k, v in times.items()},
        "gflops_per_s": {"the step's GEMMs alone": gflop_gemm / med["the step's GEMMs alone"],
                         "the step's attention kernels alone": gflop_attn / med["the step's attention kernels alone"],
                         f"sgemm {n}^3": 2 * n ** 3 / 1e9 / med[f"sgemm {n}^3"],
                         "qkv step (GEMM + attention flop)": (gflop_gemm + gflop_attn) / med["qkv step"],
                         "nanoGPT step (GEMM + attention flop)": (gflop_gemm + gflop_attn) / med["nanoGPT step"]},
        # speed ratios: > 1 means the first is faster (time of the second / time of the first)
        "ratios": {
            "qkv step vs nanoGPT step (speed)": med_ratio(nano_t, qkv_t),
            "qkv exact GELU vs nanoGPT step (speed)": med_ratio(nano_t, times["qkv step, exact GELU"]),
            "kernels / whole step, qkv (both clocked)": med_ratio(inside["qkv"], times["qkv step, kernels clocked"]),
            "kernels / whole step, nanoGPT (both clocked)": med_ratio(inside["nanoGPT"],
                                                                     times["nanoGPT step, kernels clocked"]),
            "qkv kernels in its step / nanoGPT kernels in its step (time)": med_ratio(inside["qkv"], inside["nanoGPT"]),
            "floor (qkv's in-step kernels) / nanoGPT step (time)": med_ratio(floor, nano_t),
            "nanoGPT step / floor: the largest speedup over nanoGPT with the rest at zero": med_ratio(nano_t, floor),
            "qkv's rest (step - floor) / qkv step (time)": med_ratio(rest_q, qkv_t),
            "cut needed for the 1.1x bar / qkv's rest (time)": med_ratio(target_cut, rest_q),
            "kernels replayed alone / kernels in the step (time)": med_ratio(replayed, floor),
            "by CPU time: qkv step vs nanoGPT step (speed)": med_ratio(cpu["nanoGPT step"], cpu["qkv step"]),
            "by CPU time: kernels / whole step, qkv (both clocked)": med_ratio(
                inside_cpu["qkv"], cpu["qkv step, kernels clocked"]),
            "by CPU time: kernels / whole step, nanoGPT (both clocked)": med_ratio(
                inside_cpu["nanoGPT"], cpu["nanoGPT step, kernels clocked"]),
            "by CPU time: qkv kernels in its step / nanoGPT kernels in its step": med_ratio(inside_cpu["qkv"],
                                                                                        inside_cpu["nanoGPT"]),
            "by CPU time: nanoGPT step / floor (qkv's in-step kernels)": med_ratio(cpu["nanoGPT step"],
                                                                                  inside_cpu["qkv"]),
            "qkv step with SDPA math vs with flash (speed)": med_ratio(qkv_t, times["qkv step, SDPA math"]),
            "attention fwd+bwd: math vs flash (speed)": med_ratio(times["attention fwd+bwd, flash"],
                                                                 times["attention fwd+bwd, math"]),
            "GELU fwd+bwd: tanh as x*sigmoid(2z) vs torch's tanh kernel (speed)": med_ratio(
                times["GELU fwd+bwd, tanh (qkv's GPT-2)"], times["GELU fwd+bwd, tanh as x*sigmoid(2z) (candidate)"]),
            "GELU fwd+bwd: tanh / exact (time)": med_ratio(times["GELU fwd+bwd, tanh (qkv's GPT-2)"],
                                                          times["GELU fwd+bwd, exact (nanoGPT's)"]),
        },
        "machine": {"capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
                    "machine": platform.machine(), "python": platform.python_version()},
    }
    lines = [f"fp32 training step, GPT {s['n_layer']}L/{s['n_head']}H/{s['n_embd']}, batch {s['batch']} x {s['block']}, "
             f"vocab {s['vocab']}, torch's default AdamW; {a.threads} threads, {a.rounds} interleaved rounds; "
             f"CPU {result['machine']['capability']}, torch {torch.__version__}", "",
             f"Recorded per step: {len(rec.gemms)} GEMM calls ({gflop_gemm:.1f} GFLOP) and {len(rec.attention)} "
             f"attention-kernel calls ({gflop_attn:.1f} GFLOP of causal attention products); the same calls, "
             f"shapes and strides in nanoGPT's step: {'yes' if same_kernels else 'NO'}.", "",
             "| contender | median ms | min..max ms | GFLOP/s | CPU ms |", "|---|---:|---:|---:|---:|"]
    rates = result["gflops_per_s"]
    for k in order:
        rate = rates.get(k) or rates.get(f"{k} (GEMM + attention flop)")
        lines.append(f"| {k} | {1e3 * med[k]:.1f} | {1e3 * min(times[k]):.1f}..{1e3 * max(times[k]):.1f} | "
                     f"{'' if rate is None else f'{rate:.0f}'} | {1e3 * statistics.median(cpu[k]):.0f} |")
    lines += ["", "| per-round ratio | median | min..max |", "|---|---:|---:|"]
    lines += [f"| {k} | {v['median']:.3f} | {v['min']:.3f}..{v['max']:.3f} |" for k, v in result["ratios"].items()]
    lines += ["", "floor = the wall time of the GEMM and attention-kernel calls inside qkv's step (KernelClock, a step "
              "of its own each round); rest = step - floor; \"replayed alone\" = the same calls with the same arguments "
              "run back to back outside the step. fp32 first-step losses: "
              + ", ".join(f"{k} {v:.6f}" for k, v in result["fp32_first_step_loss"].items()) + "."]
    write_results(a.out, "train_floor_quick" if a.quick else "train_floor", result, lines)
    return result


if __name__ == "__main__":
    main()
