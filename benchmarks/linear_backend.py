"""A/B of qkv's linear backends on CPU: oneDNN (`torch.ops.mkldnn._linear_pointwise`, custom backward) vs
aten (`F.linear`, MKL's sgemm), in one process, the switch toggled between interleaved rounds.

Three workloads, each on ONE model instance whose backend is switched with `qkv.nn.linear_backend` (so
both arms run the same weights, batches and code apart from the linear kernels):
  gemm  ten forward (2048 x 384) @ (384 x 1536) + bias products (the MLP's up-projection of the GPT below)
  gpt   a training step (forward + loss + backward + AdamW + zero_grad) of benchmarks/train_vs_hf.py's model:
        GPT 6L/6H/384, block 256, batch 8, vocab 65, dropout 0
  bert  a training step of a BERT-base-shaped encoder (hidden 768, 12 heads, FFN 3072; `--bert-layers`
        layers, vocab 1000, classification head), batch 8 x seq 128, dropout 0

Timing: 2 warm-up steps per arm, then `--rounds` rounds; in each round both arms run `--steps` steps, the
order reversed every other round (AB BA ...). Reported per workload: the median step time of each arm, the
median and quartiles (and min..max) of the per-round ratio aten time / oneDNN time (> 1: oneDNN faster),
and the same ratio by process CPU time (less sensitive to other jobs on a shared machine).

    .venv/bin/python benchmarks/linear_backend.py [--quick] [--rounds 12] [--steps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

import qkv  # noqa: E402
from qkv.nn import linear as L  # noqa: E402
from qkv.nn import linear_backend  # noqa: E402


def gemm(quick: bool):
    n, d, f = (256, 64, 256) if quick else (2048, 384, 1536)
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(n, d, generator=g), torch.randn(f, d, generator=g), torch.randn(f, generator=g)

    def step(i: int) -> None:
        for _ in range(10):
            L.linear(x, w, b)

    return f"gemm ({n} x {d}) @ ({d} x {f}) + bias, forward x10", step


def gpt(quick: bool):
    torch.manual_seed(0)
    s = dict(n_layers=2, d_model=64, n_heads=4, context_length=32) if quick else {}
    model = qkv.build("gpt-bench", dropout=0.0, **s).train()  # the train_vs_hf model (6L/6H/384, block 256)
    c = model.config
    batch = 2 if quick else 8
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, c.vocab_size, (batch, c.context_length), generator=g) for _ in range(3)]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))

    def step(i: int) -> None:
        x = xs[i % 3]
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    name = f"GPT {c.n_layers}L/{c.n_heads}H/{c.d_model} train step, batch {batch} x {c.context_length}"
    return name, step


def bert(quick: bool, layers: int):
    import transformers

    torch.manual_seed(0)
    h, heads, ff, seq, batch = (64, 4, 256, 32, 2) if quick else (768, 12, 3072, 128, 8)
    cfg = transformers.BertConfig(vocab_size=1000, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                                  intermediate_size=ff, max_position_embeddings=512, num_labels=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with tempfile.TemporaryDirectory() as d:
        transformers.BertForSequenceClassification(cfg).save_pretrained(d)
        model = qkv.from_pretrained(d).train()
    g = torch.Generator().manual_seed(0)
    bs = [{"input_ids": torch.randint(5, 1000, (batch, seq), generator=g),
           "labels": torch.randint(0, 2, (batch,), generator=g)} for _ in range(3)]
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01)

    def step(i: int) -> None:
        model(**bs[i % 3]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return f"BERT-shaped encoder {layers}L, hidden {h}, FFN {ff}, train step, batch {batch} x {seq}", step


def ab(step, rounds: int, steps: int) -> dict:
    arms = ("onednn", "aten")
    for arm in arms:  # warm-up: allocations, oneDNN primitive caches
        with linear_backend(arm):
            step(0)
            step(1)
    wall: dict[str, list[float]] = {a: [] for a in arms}
    cpu: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            with linear_backend(arm):
                t0, c0 = time.perf_counter(), time.process_time()
                for i in range(steps):
                    step(i)
                wall[arm].append((time.perf_counter() - t0) / steps)
                cpu[arm].append((time.process_time() - c0) / steps)
    ratios = [off / on for on, off in zip(wall["onednn"], wall["aten"])]
    cpu_ratios = [off / on for on, off in zip(cpu["onednn"], cpu["aten"])]
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"onednn_median_s": statistics.median(wall["onednn"]), "aten_median_s": statistics.median(wall["aten"]),
            "onednn_cpu_median_s": statistics.median(cpu["onednn"]), "aten_cpu_median_s": statistics.median(cpu["aten"]),
            "ratio_median": statistics.median(ratios), "ratio_q1": q[0], "ratio_q3": q[2],
            "ratio_min": min(ratios), "ratio_max": max(ratios), "cpu_ratio_median": statistics.median(cpu_ratios),
            "ratio_per_round": ratios, "cpu_ratio_per_round": cpu_ratios, "onednn_s": wall["onednn"],
            "aten_s": wall["aten"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds of 1 step (smoke test)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=3, help="steps per arm per round")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--bert-layers", type=int, default=2)
    ap.add_argument("--workloads", default="gemm,gpt,bert")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args()
    if not L.onednn_available():
        print("linear_backend: error: this torch build has no oneDNN fp32 inner product: nothing to compare",
              file=sys.stderr)
        raise SystemExit(2)
    if a.quick:
        a.rounds, a.steps, a.bert_layers = 2, 1, 1
    if a.threads:
        torch.set_num_threads(a.threads)
    builders = {"gemm": lambda: gemm(a.quick), "gpt": lambda: gpt(a.quick), "bert": lambda: bert(a.quick, a.bert_layers)}
    results = {}
    for key in [w for w in a.workloads.split(",") if w]:
        name, step = builders[key]()
        results[name] = ab(step, a.rounds, a.steps)
        r = results[name]
        print(f"{name}: aten/oneDNN time {r['ratio_median']:.3f}x (IQR {r['ratio_q1']:.2f}..{r['ratio_q3']:.2f}), "
              f"by CPU time {r['cpu_ratio_median']:.3f}x", flush=True)
    machine = {"cpu": platform.processor() or platform.machine(), "capability": torch.backends.cpu.get_cpu_capability(),
               "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()}
    out = {"benchmark": "linear_backend", "quick": a.quick, "rounds": a.rounds, "steps_per_round": a.steps,
           "auto_takes": "onednn" if L._onednn_on() else "aten" if qkv.nn.get_linear_backend() == "auto" else None,
           "workloads": results, "machine": machine}
    md = ["| workload | oneDNN median step (s) | aten median step (s) | aten / oneDNN (median of rounds) | IQR | "
          "min..max | by CPU time |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        md.append(f"| {name} | {r['onednn_median_s']:.4f} | {r['aten_median_s']:.4f} | **{r['ratio_median']:.3f}x** | "
                  f"{r['ratio_q1']:.2f}..{r['ratio_q3']:.2f} | {r['ratio_min']:.2f}..{r['ratio_max']:.2f} | "
                  f"{r['cpu_ratio_median']:.3f}x |")
    md += ["", f"> 1: oneDNN faster. {a.rounds} interleaved rounds x {a.steps} steps per arm, 2 warm-up steps per arm. "
           f"torch {torch.__version__}, CPU capability {machine['capability']}, {machine['threads']} threads, "
           f"{machine['cpu']}."]
    o = Path(a.out)
    o.mkdir(parents=True, exist_ok=True)
    stem = "linear_backend_quick" if a.quick else "linear_backend"
    (o / f"{stem}.json").write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    (o / f"{stem}.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    print("\n".join(md))


if __name__ == "__main__":
    main()
