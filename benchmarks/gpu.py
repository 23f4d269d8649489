"""qkv on one CUDA GPU, side by side with Hugging Face `transformers` in the same process.

Sections (all by default; name some to run only those):
  peak    the measured bf16 matmul ceiling (8192^3), next to the spec's dense bf16 peak (--spec-tflops)
  train   GPT-2 124M, batch 16 x 1024 tokens, bf16 autocast: tokens/s, ms/step, peak memory, TFLOP/s and MFU
          (against the spec and against the measured peak) of
            qkv bare loop, fused AdamW           | HF GPT2LMHeadModel, the same loop
            (eager and torch.compile)
            qkv bare loop doing the Trainer's work (foreach AdamW as the Trainer builds it, clip 1.0)
            qkv.train.Trainer, eager and compile=True
          The Trainer's overhead = 1 - Trainer tok/s / the bare loop doing its work.
          FLOPs per token = 6 N + 12 L d T (N: parameters without position embeddings; PaLM app. B,
          nanoGPT).
  decode  greedy decoding of GPT-2 124M (random weights, HF's and qkv's the same), 16-token prompt, 256 new
          tokens, batch 1 and 8, fp32 and bf16: ms/step (a generate() call's wall time / new tokens, median of
          --repeats interleaved calls) of qkv eager, qkv graph-captured (generate(compile=True):
          torch.compile mode="reduce-overhead", CUDA graphs over the static cache) and HF; graph tokens ==
          eager.
  flash   the SDPA kernel each attention call takes in a training step and a prefill (read from the
          profiler's aten op names: flash / efficient / cudnn / math), and the peak memory of one 8192-token
          training step (batch 1, bf16) with the fused attention, with the naive (materialised) one, and HF's
          sdpa.
  sync    torch.cuda.set_sync_debug_mode("error") over a training step (forward, backward, fused AdamW) and
          over decoding steps (eager step and graph-captured step): "ok", or the synchronising call's error.

    python benchmarks/gpu.py                        # on a CUDA machine: every section
    python benchmarks/gpu.py peak train             # some sections (-> gpu_peak_train.json / .md)
    python benchmarks/gpu.py --device cpu --smoke   # every section on the CPU at a tiny size (a test)

In --smoke the models are tiny, torch.compile uses the "eager" backend (Dynamo's tracing, no code generation,
no C++ toolchain), the rows that would compile with Inductor or trace HF's model are skipped, decoding runs at
batch 2 only, and the sync section runs on the "meta" device (any read of a tensor value raises there), since
sync debug mode is CUDA-only. Writes gpu.json (every row) and gpu.md (the tables) into --out (default
benchmarks/results; named after the sections when some are named, gpu_smoke.* in smoke mode) and prints one
JSON line per row as it goes. The whole run has not been timed on a GPU; an estimate is ~10 minutes on one
H100/H200, mostly Inductor compiling (seven compiled models): split it in two (`peak train`, then `peak decode
flash sync`) where a command has a time limit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

import qkv  # noqa: E402
from qkv.generate.graphed import GraphedSteps  # noqa: E402

SECTIONS = ("peak", "train", "decode", "flash", "sync")
ROWS: list[dict[str, Any]] = []


def emit(**row: Any) -> None:
    ROWS.append(row)
    print(json.dumps(row), flush=True)


class Bench:
    """Sizes and switches: the full GPU run, or the tiny CPU smoke form."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.dev = torch.device(a.device)
        self.cuda = self.dev.type == "cuda"
        self.smoke = a.smoke
        self.spec = a.spec_tflops * 1e12
        self.repeats = 1 if a.smoke else a.repeats
        if a.smoke:
            self.gpt = dict(vocab_size=256, n_layers=2, d_model=64, n_heads=4, context_length=64)
            self.B, self.T, self.steps, self.warm = 2, 32, a.steps or 2, 1
            self.prompt, self.new, self.long_T, self.peak_n = 4, 8, 128, 256
            self.train_backend, self.decode_compile = "eager", "eager"
            self.decode_batches, self.decode_dtypes = (2,), (torch.float32, torch.bfloat16)
        else:
            self.gpt = dict(vocab_size=50257, n_layers=12, d_model=768, n_heads=12, context_length=1024)
            self.B, self.T, self.steps, self.warm = 16, 1024, a.steps or 20, 5
            self.prompt, self.new, self.long_T, self.peak_n = 16, 256, 8192, 8192
            self.train_backend, self.decode_compile = "inductor", True
            self.decode_batches, self.decode_dtypes = (1, 8), (torch.float32, torch.bfloat16)
        self.bf16 = torch.bfloat16

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_memory(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        return round(torch.cuda.max_memory_allocated() / 2**30, 2) if self.cuda else None


# -- models ----------------------------------------------------------------------------------------------
def qkv_gpt(b: Bench, **over: Any):
    return qkv.build("gpt2", dropout=0.0, **{**b.gpt, **over})


def hf_gpt2(b: Bench, context: int | None = None, **kw: Any):
    from transformers import GPT2Config, GPT2LMHeadModel

    g = b.gpt
    c = GPT2Config(n_layer=g["n_layers"], n_head=g["n_heads"], n_embd=g["d_model"],
                   n_positions=context or g["context_length"], vocab_size=g["vocab_size"], resid_pdrop=0.0,
                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None, **kw)
    return GPT2LMHeadModel(c)


def params_without_positions(model: torch.nn.Module) -> int:
    unique = {id(p): (n, p) for n, p in model.named_parameters()}
    return sum(p.numel() for n, p in unique.values() if not (n.endswith("position.weight") or "wpe" in n))


def flops_per_token(b: Bench, model: torch.nn.Module, T: int) -> float:
    return 6 * params_without_positions(model) + 12 * b.gpt["n_layers"] * b.gpt["d_model"] * T


# -- peak ------------------------------------------------------------------------------------------------
def section_peak(b: Bench) -> float:
    n = b.peak_n
    dtype = b.bf16 if b.cuda else torch.float32  # AVX2 CPUs have no native bf16: the CPU figure is fp32
    x = torch.randn(n, n, device=b.dev, dtype=dtype)
    y = torch.randn_like(x)
    for _ in range(3):
        x @ y
    b.sync()
    reps = 10 if b.cuda else 3
    t = time.perf_counter()
    for _ in range(reps):
        x @ y
    b.sync()
    peak = 2 * n**3 / ((time.perf_counter() - t) / reps)
    emit(section="peak", dtype=str(dtype).removeprefix("torch."), n=n, tflops=round(peak / 1e12, 4),
         spec_tflops=round(b.spec / 1e12, 1), of_spec=round(peak / b.spec, 3))
    return peak


# -- train -----------------------------------------------------------------------------------------------
def bare_loop(b: Bench, model: torch.nn.Module, *, fused: bool, clip: float | None,
              compile: bool) -> dict[str, Any]:
    """The training step without the Trainer: bf16 autocast, AdamW, optional clipping."""
    model.to(b.dev).train()
    if fused:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=b.cuda or None)
    else:
        from qkv.train import TrainConfig
        from qkv.train.optim import build_optimizer

        c = TrainConfig()
        opt, _ = build_optimizer(model, lr=1e-4, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay)
    engine = torch.compile(model, backend=b.train_backend) if compile else model
    g = torch.Generator(device=b.dev).manual_seed(0)
    x = torch.randint(0, b.gpt["vocab_size"], (b.B, b.T), device=b.dev, generator=g)

    def step() -> torch.Tensor:
        with torch.autocast(b.dev.type, dtype=b.bf16):
            loss = engine(input_ids=x, labels=x).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for _ in range(b.warm):
        step()
    b.sync()
    warm_s = time.perf_counter() - t0
    b.reset_memory()
    t = time.perf_counter()
    for _ in range(b.steps):
        loss = step()
    b.sync()
    dt = (time.perf_counter() - t) / b.steps
    return dict(ms_step=round(dt * 1e3, 2), tok_s=round(b.B * b.T / dt), peak_gib=b.peak_gib(),
                loss=round(float(loss.detach()), 4), warmup_s=round(warm_s, 1))


def trainer_run(b: Bench, compile: bool) -> dict[str, Any]:
    from qkv.train import Trainer

    vocab, T = b.gpt["vocab_size"], b.T

    class RandomTokens:
        def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(index)
            x = torch.randint(0, vocab, (batch_size, T), generator=g)
            return {"input_ids": x, "labels": x}

    torch.manual_seed(0)
    model = qkv_gpt(b)
    with tempfile.TemporaryDirectory() as d:
        cfg = dict(max_steps=b.warm + b.steps, batch_size=b.B, precision="bf16",
                   device=str(b.dev), log_every=1,
                   out_dir=d, progress=False, tensorboard=False, plot=False, warmup=0, lr=1e-4,
                   compile=compile, save_every=0)
        Trainer(model, cfg, RandomTokens()).fit()
        recs = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))
                    if '"tokens_per_s"' in line]
    timed = [r["tokens_per_s"] for r in recs[b.warm:]] or [r["tokens_per_s"] for r in recs]
    tps = statistics.median(timed)
    return dict(ms_step=round(b.B * T / tps * 1e3, 2), tok_s=round(tps), loss=round(recs[-1]["loss"], 4),
                steps_timed=len(timed))


def section_train(b: Bench, peak: float | None) -> None:
    variants = [
        ("qkv bare loop", "qkv", dict(fused=True, clip=None, compile=False)),
        ("HF GPT2LMHeadModel bare loop", "hf", dict(fused=True, clip=None, compile=False)),
        ("qkv bare loop + torch.compile", "qkv", dict(fused=True, clip=None, compile=True)),
        ("HF bare loop + torch.compile", "hf", dict(fused=True, clip=None, compile=True)),
        ("qkv bare loop, the Trainer's work (foreach AdamW, clip 1.0)", "qkv",
         dict(fused=False, clip=1.0, compile=False)),
        ("qkv bare loop, the Trainer's work + torch.compile", "qkv",
         dict(fused=False, clip=1.0, compile=True)),
    ]
    results: dict[str, dict[str, Any]] = {}
    flops = None
    for name, impl, kw in variants:
        if b.smoke and kw["compile"] and (impl == "hf" or not kw["fused"]):
            emit(section="train", impl=name, skipped="smoke: one compiled row is enough to exercise the path")
            continue
        torch.manual_seed(0)
        model = qkv_gpt(b) if impl == "qkv" else hf_gpt2(b)
        flops = flops_per_token(b, model, b.T)
        r = results[name] = bare_loop(b, model, **kw)
        emit(section="train", impl=name, **r, **mfu(b, flops, r["tok_s"], peak))
        del model
        b.reset_memory()
    for compile in (False, True):
        name = "qkv.train.Trainer" + (" compile=True" if compile else "")
        if compile and b.smoke:
            emit(section="train", impl=name,
                 skipped="smoke: the Trainer compiles with Inductor (C++ codegen)")
            continue
        r = trainer_run(b, compile)
        bare = results["qkv bare loop, the Trainer's work" + (" + torch.compile" if compile else "") +
                       ("" if compile else " (foreach AdamW, clip 1.0)")]
        # the bare loop reuses one batch on the device; the Trainer makes each batch on the host and copies it
        emit(section="train", impl=name, **r, **mfu(b, flops, r["tok_s"], peak),
             trainer_overhead=round(1 - r["tok_s"] / bare["tok_s"], 3))
        b.reset_memory()


def mfu(b: Bench, flops: float, tok_s: float, peak: float | None) -> dict[str, Any]:
    f = flops * tok_s
    out = dict(tflops=round(f / 1e12, 3), mfu_spec=round(f / b.spec, 4))
    if peak:
        out["mfu_measured_peak"] = round(f / peak, 4)
    return out


# -- decode ----------------------------------------------------------------------------------------------
def section_decode(b: Bench) -> None:
    from qkv.generate import generate

    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        hf = hf_gpt2(b, initializer_range=0.2)  # a wide init: far from uniform logits, few near ties
        hf.save_pretrained(d)
        ours = qkv.from_pretrained(d)
    n = b.new
    for dtype in b.decode_dtypes:
        hf_m, q = hf.to(b.dev, dtype).eval(), ours.to(b.dev, dtype).eval()
        for B in b.decode_batches:
            x = torch.randint(0, b.gpt["vocab_size"], (B, b.prompt), device=b.dev,
                              generator=torch.Generator(device=b.dev).manual_seed(B))
            calls = {
                "qkv eager": lambda x=x, q=q: generate(q, x, n),
                "qkv graph-captured": lambda x=x, q=q: generate(q, x, n, compile=b.decode_compile),
                "HF generate": lambda x=x, h=hf_m: h.generate(x, max_new_tokens=n, min_new_tokens=n,
                                                              do_sample=False,
                                                              pad_token_id=0, eos_token_id=None),
            }
            outs, times = {}, {k: [] for k in calls}
            with torch.no_grad():
                t = time.perf_counter()
                for k, fn in calls.items():  # warm-up (the graph-captured call compiles here)
                    outs[k] = fn()
                b.sync()
                compile_s = time.perf_counter() - t
                for _ in range(b.repeats):  # interleaved: drift hits every implementation alike
                    for k, fn in calls.items():
                        t = time.perf_counter()
                        outs[k] = fn()
                        b.sync()
                        times[k].append(time.perf_counter() - t)
            eager = outs["qkv eager"][:, b.prompt:]
            graph_equal = bool(torch.equal(outs["qkv graph-captured"][:, b.prompt:], eager))
            hf_agree = float((outs["HF generate"][:, b.prompt:] == eager).float().mean())
            for k in calls:
                med = statistics.median(times[k])
                emit(section="decode", impl=k, dtype=str(dtype).removeprefix("torch."), batch=B, new_tokens=n,
                     ms_step=round(med / n * 1e3, 3), tok_s=round(B * n / med, 1),
                     vs_hf=round(statistics.median(times["HF generate"]) / med, 2),
                     **({"tokens_equal_eager": graph_equal, "warmup_incl_compile_s": round(compile_s, 1)}
                        if k == "qkv graph-captured" else {}),
                     **({"token_agreement_with_qkv_eager": round(hf_agree, 4)} if k == "HF generate" else {}))
        hf.cpu()
        ours.cpu()
        b.reset_memory()


# -- flash -----------------------------------------------------------------------------------------------
SDPA_OPS = {"flash": "_scaled_dot_product_flash_attention",
            "efficient": "_scaled_dot_product_efficient_attention",
            "cudnn": "_scaled_dot_product_cudnn_attention", "math": "_scaled_dot_product_attention_math"}


def sdpa_kernels(fn) -> dict[str, int]:
    """How many calls of each SDPA implementation `fn` makes, from the profiler's aten op names (backward
    ops counted too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts: dict[str, int] = {}
    for e in prof.key_averages():
        for kind, op in SDPA_OPS.items():
            if e.key.startswith("aten::" + op) and "backward" not in e.key:
                counts[kind] = counts.get(kind, 0) + e.count
    return counts


def section_flash(b: Bench) -> None:
    torch.manual_seed(0)
    m = qkv_gpt(b).to(b.dev)
    x = torch.randint(0, b.gpt["vocab_size"], (2, b.T), device=b.dev)

    def train_step() -> None:
        m.train()
        with torch.autocast(b.dev.type, dtype=b.bf16):
            m(x, labels=x).loss.backward()
        b.sync()

    def prefill() -> None:
        m.eval()
        with torch.no_grad(), torch.autocast(b.dev.type, dtype=b.bf16):
            m(x[:, : b.T // 2], cache=m.make_cache(2, b.T))
        b.sync()

    for what, fn in (("training step", train_step), ("prefill into the static cache", prefill)):
        fn()
        counts = sdpa_kernels(fn)
        emit(section="flash", what=what, sdpa_calls=counts, flash_taken=bool(counts.get("flash"))
             and set(counts) == {"flash"}, layers=b.gpt["n_layers"])
    m.to("cpu")  # out of the way of the long step's memory figure
    b.reset_memory()
    # one long training step: what the fused kernel saves is the (T x T) score matrices
    T = b.long_T
    for name, build in (("qkv fused (SDPA)", lambda: qkv_gpt(b, context_length=T)),
                        ("qkv naive (scores materialised)",
                         lambda: qkv_gpt(b, context_length=T, attention="naive")),
                        ("HF GPT2LMHeadModel (sdpa)", lambda: hf_gpt2(b, context=T))):
        torch.manual_seed(0)
        model = build().to(b.dev).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=b.cuda or None)
        ids = torch.randint(0, b.gpt["vocab_size"], (1, T), device=b.dev)
        b.reset_memory()
        try:
            t = time.perf_counter()
            with torch.autocast(b.dev.type, dtype=b.bf16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            b.sync()
            emit(section="flash",
                 what=f"one {T}-token training step (batch 1, bf16 autocast, AdamW)", impl=name,
                 peak_gib=b.peak_gib(), ms=round((time.perf_counter() - t) * 1e3, 1),
                 loss=round(float(loss), 5))
        except torch.OutOfMemoryError as e:
            emit(section="flash", what=f"one {T}-token training step", impl=name,
                 error=f"out of memory: {e}"[:200])
        del model, opt
        b.reset_memory()


# -- sync ------------------------------------------------------------------------------------------------
@contextmanager
def sync_errors(b: Bench):
    if b.cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        if b.cuda:
            torch.cuda.set_sync_debug_mode("default")


def section_sync(b: Bench) -> None:
    dev = b.dev if b.cuda else torch.device("meta")  # meta: every read of a value raises (the CPU proxy)
    torch.manual_seed(0)
    with dev if not b.cuda else nullcontext():
        m = qkv_gpt(b)
    m.to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True if b.cuda else None)
    x = torch.zeros(2, b.T // 2, dtype=torch.long, device=dev) if not b.cuda else \
        torch.randint(0, b.gpt["vocab_size"], (2, b.T // 2), device=dev)

    def train_step() -> None:
        with torch.autocast("cuda", dtype=b.bf16) if b.cuda else nullcontext():
            loss = m(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def check(what: str, fn) -> None:
        try:
            with sync_errors(b):
                fn()
            emit(section="sync", what=what, result="ok",
                 checked_by="cuda sync debug mode" if b.cuda else "meta device")
        except RuntimeError as e:
            emit(section="sync", what=what, result=f"SYNC: {e}"[:300])

    m.train()
    train_step()  # optimizer state is created at the first step
    check("training step (forward, backward, AdamW)", train_step)
    m.eval()
    with torch.no_grad():
        cache, graph_cache = m.make_cache(2, b.T), m.make_cache(2, b.T)
        m(x, cache=cache)
        m(x, cache=graph_cache)
        tok = x[:, -1:]
        check("decoding step (eager, static cache)", lambda: [m.step(tok, cache) for _ in range(4)])
        if b.cuda:
            graphed = GraphedSteps(m, True, graph_cache, None, None)
            for _ in range(3):
                graphed(tok)  # compile, CUDA-graph warm-up and recording
            check("decoding step (graph-captured)", lambda: [graphed(tok) for _ in range(4)])
        else:
            index = torch.full((1,), graph_cache.length, dtype=torch.long, device=dev)
            check("decoding step (static_step, what is graph-captured)",
                  lambda: [m.static_step(tok, graph_cache, index=index, offset=index) for _ in range(4)])


# -- report ----------------------------------------------------------------------------------------------
def markdown(meta: dict[str, Any]) -> str:
    lines = [f"# benchmarks/gpu.py ({'smoke, ' if meta['smoke'] else ''}{meta['device_name']})", "",
             f"torch {meta['torch']}, transformers {meta['transformers']}, {meta['when']}. Command: "
             f"`{meta['command']}`", ""]
    by = lambda s: [r for r in ROWS if r["section"] == s and "done_s" not in r and "section_error" not in r]  # noqa: E731
    if by("peak"):
        p = by("peak")[0]
        lines += [f"Peak: measured {p['tflops']} TFLOP/s ({p['dtype']} {p['n']}^3 matmul) = "
                  f"{p['of_spec']:.0%} of the spec's {p['spec_tflops']}.", ""]
    if by("train"):
        lines += ["## Training (GPT-2 124M shape, bf16 autocast)", "",
                  "| implementation | tok/s | ms/step | peak GiB | TFLOP/s | MFU (spec) | MFU (measured "
                  "peak) | Trainer overhead |", "|---|---|---|---|---|---|---|---|"]
        for r in by("train"):
            if "skipped" in r:
                lines.append(f"| {r['impl']} | skipped: {r['skipped']} | | | | | | |")
                continue
            lines.append(f"| {r['impl']} | {r['tok_s']:,} | {r['ms_step']} | {r.get('peak_gib') or '-'} | "
                         f"{r['tflops']} | {r['mfu_spec']:.1%} | {r.get('mfu_measured_peak', 0):.1%} | "
                         f"{'' if 'trainer_overhead' not in r else format(r['trainer_overhead'], '.1%')} |")
        lines.append("")
    if by("decode"):
        lines += ["## Greedy decoding (GPT-2 124M shape)", "",
                  "| dtype | batch | implementation | ms/step | tok/s | x HF | graph tokens == eager |",
                  "|---|---|---|---|---|---|---|"]
        for r in by("decode"):
            lines.append(f"| {r['dtype']} | {r['batch']} | {r['impl']} | {r['ms_step']} | {r['tok_s']} | "
                         f"{r['vs_hf']} | {r.get('tokens_equal_eager', '')} |")
        lines.append("")
    if by("flash"):
        lines += ["## Attention kernels and long-sequence memory", ""]
        for r in by("flash"):
            if "sdpa_calls" in r:
                lines.append(f"- {r['what']}: SDPA calls {r['sdpa_calls']}; flash only: {r['flash_taken']}")
            else:
                lines.append(f"- {r['what']}, {r['impl']}: " +
                             (f"peak {r['peak_gib'] or '-'} GiB, {r['ms']} ms" if "error" not in r
                                  else r["error"]))
        lines.append("")
    if by("sync"):
        lines += ["## Host synchronisation",
                  ""] + [f"- {r['what']}: {r['result']}" for r in by("sync")] + [""]
    errors = [r for r in ROWS if "section_error" in r]
    if errors:
        lines += ["## Errors", ""] + [f"- {r['section']}: {r['section_error']}" for r in errors]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sections", nargs="*", help=f"any of {SECTIONS} (default: all)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", "--quick", action="store_true",
                    help="tiny sizes, tracing-only compile backends (CPU test)")
    ap.add_argument("--steps", type=int, default=0, help="timed training steps (default 20; smoke 2)")
    ap.add_argument("--repeats", type=int, default=3, help="timed generate() calls per implementation")
    ap.add_argument("--spec-tflops", type=float, default=989.0,
                    help="dense bf16 spec peak (H100/H200 SXM: 989)")
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    a = ap.parse_args()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("no CUDA device here: pass --device cpu --smoke")
    sections = a.sections or list(SECTIONS)
    for s in sections:
        if s not in SECTIONS:
            ap.error(f"unknown section {s!r}; choose from {SECTIONS}")
    b = Bench(a)
    import transformers

    transformers.logging.set_verbosity_error()
    if b.cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    meta = dict(torch=torch.__version__, transformers=transformers.__version__, smoke=a.smoke,
                device=str(b.dev),
                device_name=torch.cuda.get_device_name(b.dev) if b.cuda
                    else f"CPU {platform.processor() or platform.machine()}",
                cuda=torch.version.cuda, when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                command="python benchmarks/gpu.py " + " ".join(sys.argv[1:]), sections=sections)
    emit(section="env", **meta)
    peak = None
    for s in sections:
        t = time.perf_counter()
        try:
            if s == "peak":
                peak = section_peak(b)
            elif s == "train":
                section_train(b, peak)
            elif s == "decode":
                section_decode(b)
            elif s == "flash":
                section_flash(b)
            elif s == "sync":
                section_sync(b)
        except Exception as e:  # one section's failure is reported, and the others still run
            emit(section=s, section_error=f"{type(e).__name__}: {e}"[:500])
        emit(section=s, done_s=round(time.perf_counter() - t, 1))
    a.out.mkdir(parents=True, exist_ok=True)
    stem = "gpu" + ("" if not a.sections else "_" + "_".join(sections)) + ("_smoke" if a.smoke else "")
    (a.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": ROWS}, indent=1))
    (a.out / f"{stem}.md").write_text(markdown(meta))
    print(markdown(meta))
    if any("section_error" in r for r in ROWS):
        sys.exit(1)


if __name__ == "__main__":
    main()
