"""Where the time goes, op by op: qkv against its reference, under torch.profiler, in one process.

Two comparisons, each the same work on the same weights, profiled in interleaved rounds (A B .. B A ..):
  prefill  one forward over a B=1 prompt, last-position logits (as benchmarks/prefill.py): qkv
           `model(ids, last_only=True)` vs transformers `model(ids, logits_to_keep=1)`; --family gpt2|llama.
  step     one batch-1 greedy decoding step over a 32-token prompt's cache : qkv
           `model.step(ids, cache)` vs a transformers forward with its cache (one new token); the caches are
           cut back after each profiled step, so every round times the same position; --family gpt2|llama.
           Calls per step / number of layers = aten ops per layer.
  beam     one beam search (num_beams 4, length_penalty 0.6, no_repeat_ngram_size 3, early stopping, 32 new
           tokens) of a batch of --tokens source sentences (default 16 when --tokens is not given) through the
           Marian-shaped model of benchmarks/seq2seq_beam.py: qkv `generate` vs `MarianMTModel.generate`, the
           same weights and sources.
  train    one fp32 training step (forward + loss + backward + AdamW + zero_grad, as
           benchmarks/train_vs_nanogpt.py): qkv GPT (GPT-2's tanh GELU), qkv GPT with the exact GELU, and
           nanoGPT's model.py (--nanogpt PATH, never shipped).
The table gives each aten op's self CPU ms per forward / step (summed over threads, averaged over the rounds)
and its calls, so equal kernels show up as equal call counts and any op one side runs and the other does not
stands out. Wrapper ops (aten::linear, aten::matmul, autograd nodes) are left out: their kernels are counted
in the ops below them.

    .venv/bin/python benchmarks/profile_ops.py prefill --family gpt2 --tokens 2048 [--rounds 3]
    .venv/bin/python benchmarks/profile_ops.py step --family llama [--rounds 20] [--dtype bfloat16]
        [--batch 8]
    .venv/bin/python benchmarks/profile_ops.py train --nanogpt PATH/model.py [--rounds 4]
    .venv/bin/python benchmarks/profile_ops.py beam --threads 1 [--rounds 2]

--quick: tiny models, one round (the smoke test, tests/benchmarks/test_profile_ops_bench.py). Writes
OUT/profile_<what>[_<family>[_<tokens>]].json and .md (OUT = benchmarks/results).
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

WRAPPERS = ("autograd::", "Optimizer.", "aten::linear", "aten::matmul")


def contenders(a: argparse.Namespace) -> tuple[dict, str]:
    """{name: zero-argument callable doing one unit of work} and a one-line description."""
    if a.what == "prefill":
        from prefill import build

        n = 16 if a.quick else a.tokens
        hf, ours = build(a.family, a.quick, Path(tempfile.mkdtemp(prefix="qkv-prof-")), n)
        x = torch.randint(4, ours.output_vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
        fns = {"qkv": lambda: ours(x, last_only=True), "transformers": lambda: hf(x, logits_to_keep=1)}
        return fns, f"prefill, {a.family}, {n} tokens, batch 1, fp32, last-position logits; ms per forward"
    if a.what == "step":
        return step_contenders(a)
    if a.what == "beam":
        return beam_contenders(a)
    import train_vs_nanogpt as tv

    s = tv.QUICK if a.quick else tv.FULL
    ours, nano, _, exact, _ = tv.build_models(tv.load_nanogpt(a.nanogpt), s)
    x = torch.randint(0, s["vocab"], (s["batch"], s["block"]), generator=torch.Generator().manual_seed(0))
    steps = {"qkv": tv.make_step("qkv GPT", ours, "fp32"),
             "qkv exact GELU": tv.make_step("qkv GPT, exact GELU", exact, "fp32"),
             "nanoGPT": tv.make_step("nanoGPT GPT", nano, "fp32")}
    fns = {k: (lambda f=f: f(x)) for k, f in steps.items()}
    return fns, (f"fp32 training step, GPT {s['n_layer']}L/{s['n_head']}H/{s['n_embd']}, batch {s['batch']} "
                 f"x {s['block']}, AdamW torch default (per-parameter loop on CPU); ms per step")


def step_contenders(a: argparse.Namespace) -> tuple[dict, str]:
    """One decoding step at batch --batch in each library, at the same position every call (the caches are cut
    back). --dtype bfloat16: both models from the same weights saved as a bf16 folder."""
    import qkv
    from prefill import build

    prompt_len = 8 if a.quick else 32
    tmp = Path(tempfile.mkdtemp(prefix="qkv-prof-"))
    hf, ours = build(a.family, a.quick, tmp, prompt_len + 8)
    if a.dtype != "float32":  # the fp32 weights rounded once, saved as a folder in that dtype, loaded by both
        hf = hf.to(getattr(torch, a.dtype))
        hf.save_pretrained(tmp / a.dtype)
        ours = qkv.from_pretrained(tmp / a.dtype).eval()
    B = a.batch
    x = torch.randint(4, ours.output_vocab_size, (B, prompt_len), generator=torch.Generator().manual_seed(0))
    nxt = torch.full((B, 1), 5)
    with torch.no_grad():
        cache = ours.make_cache(B, prompt_len + 2)
        ours.prefill(x, cache)
        past = hf(x, use_cache=True).past_key_values

    def qkv_step() -> None:
        ours.step(nxt, cache).argmax(-1)
        cache.length = prompt_len  # the next call writes the same column again

    def hf_step() -> None:
        hf(nxt, past_key_values=past, use_cache=True).logits[:, -1].argmax(-1)
        past.crop(-1)  # drop the token just added (this transformers takes a negative count)

    layers = len(ours.decoder.blocks)
    return ({"qkv": qkv_step, "transformers": hf_step},
            f"decoding step, {a.family} ({layers} layers), batch {B}, {a.dtype}, after a {prompt_len}-token "
            f"prompt, argmax included; ms per step")


def beam_contenders(a: argparse.Namespace) -> tuple[dict, str]:
    """One beam search over a batch of sentences in each library (benchmarks/seq2seq_beam.py's model and
    inputs)."""
    import seq2seq_beam as sb
    from qkv.generate import generate

    shape = sb.QUICK if a.quick else sb.FULL
    n = 4 if a.quick else (a.tokens if a.tokens_given else 16)
    new = 8 if a.quick else 32
    hf, ours = sb.build_models(shape)
    x, m = sb.sources(n, shape["vocab_size"], n)[0]
    opts = dict(sb.BEAM, max_new_tokens=new)
    fns = {"qkv": lambda: generate(ours, x, attention_mask=m, **opts),
           "transformers": lambda: hf.generate(input_ids=x, attention_mask=m, do_sample=False, **opts)}
    return fns, (f"beam search (num_beams 4, lp 0.6, no_repeat_ngram 3, early stopping, {new} new tokens), "
                 f"Marian-shaped ({shape['decoder_layers']}+{shape['encoder_layers']} layers, "
                 f"{shape['d_model']} wide, vocabulary {shape['vocab_size']}), {n} sentences, fp32; ms per "
                 "beam search")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["prefill", "step", "train", "beam"])
    ap.add_argument("--family", default="gpt2", choices=["gpt2", "llama"])
    ap.add_argument("--tokens", type=int, default=None,
                    help="prefill: prompt tokens (2048); beam: sentences (16)")
    ap.add_argument("--nanogpt", default=None, metavar="PATH", help="nanoGPT's model.py (train)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights of step")
    ap.add_argument("--batch", type=int, default=1, help="rows of step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-ms", type=float, default=3.0, help="ops under this on every side go into one row")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args(argv)
    if a.what == "train" and not a.nanogpt:
        ap.error("train needs --nanogpt PATH (nanoGPT's model.py)")
    a.tokens_given = a.tokens is not None
    a.tokens = a.tokens if a.tokens is not None else 2048
    if a.quick:
        a.rounds = 1
    torch.set_num_threads(a.threads)
    fns, what = contenders(a)
    names = list(fns)
    ms = {k: collections.Counter() for k in names}
    calls = {k: collections.Counter() for k in names}
    wall: dict[str, list[float]] = {k: [] for k in names}
    # every aten op called, wrappers and views included (the dispatcher's work)
    dispatched = collections.Counter()
    with torch.inference_mode(False), (torch.no_grad() if a.what != "train" else torch.enable_grad()):
        for f in fns.values():  # warm-up
            f()
        for r in range(a.rounds):
            for k in (names if r % 2 == 0 else names[::-1]):
                with profile(activities=[ProfilerActivity.CPU]) as p:
                    t0 = time.perf_counter()
                    fns[k]()
                    wall[k].append(time.perf_counter() - t0)
                for e in p.key_averages():
                    dispatched[k] += e.count / a.rounds if e.key.startswith("aten::") else 0
                    if e.key.startswith(WRAPPERS) or e.key.endswith("Backward0"):
                        continue
                    ms[k][e.key] += e.self_cpu_time_total / 1e3 / a.rounds
                    calls[k][e.key] += e.count / a.rounds
    ref = names[-1]
    keys = sorted(set().union(*ms.values()), key=lambda s: -sum(ms[k][s] for k in names))
    rows, rest = [], {k: 0.0 for k in names}
    for s in keys:
        if max(ms[k][s] for k in names) < a.min_ms:
            for k in names:
                rest[k] += ms[k][s]
            continue
        rows.append({"op": s, **{f"{k} ms": round(ms[k][s], 2) for k in names},
                     **{f"{k} calls": round(calls[k][s], 1) for k in names}})
    total = {k: round(sum(ms[k].values()), 1) for k in names}
    med = {k: round(statistics.median(v) * 1e3, 1) for k, v in wall.items()}
    lines = [f"{what}; self CPU time summed over {a.threads} threads, mean of {a.rounds} interleaved "
             f"profiled rounds; CPU {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}", "",
             "| op | " + " | ".join(f"{k} ms (calls)" for k in names) + f" | qkv - {ref} ms |",
             "|---|" + "---:|" * (len(names) + 1)]
    lines += [f"| {r['op']} | " + " | ".join(f"{r[f'{k} ms']:.1f} ({r[f'{k} calls']:.0f})" for k in names)
              + f" | {r['qkv ms'] - r[f'{ref} ms']:+.1f} |" for r in rows]
    lines += [f"| every other op (< {a.min_ms:g} ms on each side) | "
              + " | ".join(f"{rest[k]:.1f}" for k in names)
              + f" | {rest['qkv'] - rest[ref]:+.1f} |",
              "| total self CPU | " + " | ".join(f"{total[k]:.1f}" for k in names)
              + f" | {total['qkv'] - total[ref]:+.1f} |",
              "| median wall ms (profiled) | " + " | ".join(f"{med[k]:.0f}" for k in names) + " | |",
              "| aten ops called (views and wrappers included) | "
              + " | ".join(f"{dispatched[k]:.0f}" for k in names)
              + f" | {dispatched['qkv'] - dispatched[ref]:+.0f} |"]
    table = "\n".join(lines) + "\n"
    result = {"what": what, "rows": rows, "total_ms": total, "median_wall_ms": med, "rounds": a.rounds,
              "aten_calls": {k: round(dispatched[k], 1) for k in names},
              "threads": a.threads, "quick": a.quick, "torch": torch.__version__,
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine()}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "profile_" + a.what + (f"_{a.family}_{16 if a.quick else a.tokens}" if a.what == "prefill" else "")
    stem += f"_{a.family}" if a.what == "step" else ""
    stem += f"_{4 if a.quick else (a.tokens if a.tokens_given else 16)}" if a.what == "beam" else ""
    stem += f"_{a.dtype}" if a.what == "step" and a.dtype != "float32" else ""
    stem += f"_b{a.batch}" if a.what == "step" and a.batch != 1 else ""
    stem += "_quick" if a.quick else ""
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out / f"{stem}.md").write_text(table, encoding="utf-8")
    print(table)
    return result


if __name__ == "__main__":
    main()
