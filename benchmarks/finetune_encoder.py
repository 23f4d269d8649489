"""Fine-tuning step throughput: qkv BERT (classify head) vs Hugging Face BertForSequenceClassification.

One step = forward with the classification loss + backward + AdamW step + zero_grad, on a BERT-base-shaped
model (hidden 768, 12 heads, FFN 3072, vocab 30522; --layers, default 12) with random weights, batch 16 x
seq 128 with a padding mask (row lengths 64..128, as dynamic padding leaves them), dropout 0, fp32 and bf16
(torch.autocast on the device, the same for both). Both start from the SAME weights (the HF model is saved to
a temporary folder and loaded through qkv.from_pretrained), see the SAME batches and use the same optimizer;
the first step's losses are printed to show that both compute the same function.

Optimizers: the rows "qkv BERT ..." and "HF ..." all train with the same `torch.optim.AdamW(lr=2e-5,
wd=0.01)` (`--optimizer`: torch's default, on CPU the per-parameter loop; foreach; fused), no clipping: only
the models differ. The rows "recipe: ..." (`--no-recipes` skips them) use the AdamW each project's trainer
builds, with clip_grad_norm_(1.0) as both trainers do by default: qkv's `qkv.train.build_optimizer` (what `qkv
finetune` trains with: fused on CPU and CUDA, no decay on norms, biases and embeddings) and the one
`transformers.Trainer` builds by default (`TrainingArguments.optim`, "adamw_torch_fused" for torch >= 2.8:
fused; no decay on biases and LayerNorm weights; betas (0.9, 0.999)). qkv's own recipe: lr 2e-5, wd 0.01,
betas (0.9, 0.999), eps 1e-8 for both.

Timing: `--warmup` steps each, then `--repeats` rounds; in each round every (model, dtype) pair runs `--steps`
steps, the order reversed every other round (ABBA) so drift of a shared machine hits all alike. Reported:
median tokens/s (padding included: the tokens the models process) and the median of per-round ratios.

    .venv/bin/python benchmarks/finetune_encoder.py [--quick] [--layers N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

import qkv  # noqa: E402
from qkv.train import build_optimizer  # noqa: E402
from qkv.train.optim import implementation  # noqa: E402

RECIPE_QKV = "recipe: qkv BERT, qkv Trainer's AdamW + clip"
RECIPE_HF = "recipe: HF BERT, HF Trainer's AdamW + clip"

BASE = dict(hidden=768, heads=12, ff=3072, vocab=30522, seq=128, batch=16, labels=2)
QUICK = dict(hidden=64, heads=4, ff=128, vocab=1000, seq=32, batch=4, labels=2)


def build_models(shape: dict, layers: int, device: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                                  num_hidden_layers=layers,
                                  num_attention_heads=shape["heads"], intermediate_size=shape["ff"],
                                  max_position_embeddings=512, num_labels=shape["labels"],
                                  hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    hf = transformers.BertForSequenceClassification(cfg)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = qkv.from_pretrained(d)
    assert ours.config.head == "classify" and ours.config.dropout == 0.0
    return hf.to(device).train(), ours.to(device).train(), transformers.__version__


def batches(shape: dict, n: int, device: str) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        B, T = shape["batch"], shape["seq"]
        ids = torch.randint(1000 if shape["vocab"] > 2000 else 5, shape["vocab"], (B, T), generator=g)
        lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
        lengths[0] = T
        mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
        out.append({"input_ids": (ids * mask).to(device), "attention_mask": mask.to(device),
                    "token_type_ids": torch.zeros_like(ids).to(device),
                    "labels": torch.randint(0, shape["labels"], (B,), generator=g).to(device)})
    return out


# --optimizer: all models alike
OPTIMIZERS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def hf_trainer_optimizer(model) -> torch.optim.Optimizer:
    """The AdamW `transformers.Trainer` builds with default TrainingArguments (lr and wd as below): its
    decay split (Trainer.get_decay_parameter_names: not in a LayerNorm, no bias/norm in the name) and its
    default `optim` (read from the TrainingArguments field, so it follows the installed version)."""
    import dataclasses

    import transformers
    from transformers.trainer_pt_utils import get_parameter_names

    optim = str({f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)}["optim"])
    optim = getattr(optim, "value", optim)
    patterns = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    decay = set(get_parameter_names(model, [torch.nn.LayerNorm], patterns))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": 0.01},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    if optim not in ("adamw_torch", "adamw_torch_fused", "OptimizerNames.ADAMW_TORCH",
                     "OptimizerNames.ADAMW_TORCH_FUSED"):
        raise SystemExit(f"finetune_encoder: error: transformers' default optim {optim!r} is not torch's "
                         "AdamW")
    return torch.optim.AdamW(groups, lr=2e-5, betas=(0.9, 0.999), eps=1e-8,
                             fused=optim.lower().endswith("fused"))


def make_step(model, dtype: str, device: str, optimizer: str = "default",
              opt: torch.optim.Optimizer | None = None):
    """One optimizer step of `model` (bf16: under torch.autocast). With `opt` given (a project's recipe) the
    gradients are clipped to norm 1.0 first, as both trainers do."""
    clip = opt is not None
    opt = opt or torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01, **OPTIMIZERS[optimizer])

    def step(b: dict[str, torch.Tensor]) -> float:
        ctx = torch.autocast(device, dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()
        with ctx:
            loss = model(**b).loss
        loss.float().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        return float(loss.detach())

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a tiny model, 1 warmup, 2 rounds of 1 step (smoke test)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=1, help="steps per (model, dtype) per round")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-padded-row", dest="padded_row", action="store_false",
                    help="skip the qkv runs with unpadding off (all B x T positions through every layer, as "
                         "HF)")
    ap.add_argument("--optimizer", default="default", choices=list(OPTIMIZERS),
                    help="AdamW for the model-comparison rows (all alike): torch's default (CPU: the loop), "
                         "foreach, fused")
    ap.add_argument("--no-recipes", dest="recipes", action="store_false",
                    help="skip the rows with each project's own trainer AdamW (+ clipping)")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args()
    shape = dict(QUICK if a.quick else BASE)
    if a.quick:
        a.layers, a.warmup, a.repeats, a.steps = 1, 1, 2, 1
    if a.threads:
        torch.set_num_threads(a.threads)
    dtypes = [d for d in a.dtypes.split(",") if d]

    hf, ours, tf_version = build_models(shape, a.layers, a.device)
    data = batches(shape, 3, a.device)
    tokens = shape["batch"] * shape["seq"]
    # one model copy per (model, dtype): each keeps its own optimizer state, all from the same weights
    steps = {}
    recipe_impls: dict[str, str] = {}
    for dt in dtypes:
        steps[("qkv BERT", dt)] = make_step(copy.deepcopy(ours), dt, a.device, optimizer=a.optimizer)
        steps[("HF BertForSequenceClassification (sdpa)", dt)] = make_step(copy.deepcopy(hf), dt, a.device,
                                                                            optimizer=a.optimizer)
        if a.padded_row:
            padded = copy.deepcopy(ours)
            padded.unpad_in_training = False  # every layer on all B x T positions, as HF
            steps[("qkv BERT, unpadding off", dt)] = make_step(padded, dt, a.device, optimizer=a.optimizer)
        if a.recipes:
            q = copy.deepcopy(ours)
            q_opt, _ = build_optimizer(q, lr=2e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
            steps[(RECIPE_QKV, dt)] = make_step(q, dt, a.device, opt=q_opt)
            h = copy.deepcopy(hf)
            h_opt = hf_trainer_optimizer(h)
            steps[(RECIPE_HF, dt)] = make_step(h, dt, a.device, opt=h_opt)
            recipe_impls = {"qkv": implementation(q_opt), "HF": implementation(h_opt)}
    first = {f"{m} {dt}": fn(data[0]) for (m, dt), fn in steps.items()}
    print("first-step loss: " + ", ".join(f"{k} {v:.6f}" for k, v in first.items()), flush=True)
    for fn in steps.values():
        for i in range(a.warmup - 1):
            fn(data[(i + 1) % len(data)])

    times: dict[tuple[str, str], list[float]] = {k: [] for k in steps}
    cpu: dict[tuple[str, str], list[float]] = {k: [] for k in steps}  # process CPU time: less sensitive to
    order = list(steps)  # other jobs on a shared machine than wall time (both sides' threads counted alike)
    for r in range(a.repeats):
        for key in (order if r % 2 == 0 else order[::-1]):
            t0, c0 = time.perf_counter(), time.process_time()
            for s in range(a.steps):
                steps[key](data[s % len(data)])
            times[key].append((time.perf_counter() - t0) / a.steps)
            cpu[key].append((time.process_time() - c0) / a.steps)
        print(f"round {r + 1}/{a.repeats}: " + ", ".join(f"{m} {dt} {tokens / v[-1]:.0f} tok/s"
                                                     for (m, dt), v in times.items()), flush=True)

    rows, ratios = [], {}
    for dt in dtypes:
        hf_key = ("HF BertForSequenceClassification (sdpa)", dt)
        o, h, hc = times[("qkv BERT", dt)], times[hf_key], cpu[hf_key]
        per_round = [hh / oo for oo, hh in zip(o, h)]
        per_round_cpu = [hh / oo for oo, hh in zip(cpu[("qkv BERT", dt)], hc)]
        ratios[dt] = {"per_round": per_round, "median": statistics.median(per_round),
                      "per_round_cpu_time": per_round_cpu,
                      "median_cpu_time": statistics.median(per_round_cpu)}
        if (RECIPE_HF, dt) in times:  # each project's trainer optimizer: qkv's recipe vs HF's
            rq, rh = times[(RECIPE_QKV, dt)], times[(RECIPE_HF, dt)]
            pr = [hh / oo for oo, hh in zip(rq, rh)]
            ratios[dt]["recipe"] = {"per_round": pr, "median": statistics.median(pr)}
        for (m, d2), t in times.items():
            if d2 == dt:
                med = statistics.median(t)
                # recipe rows against HF's recipe row, the others against HF with the same optimizer
                ref = (RECIPE_HF, dt) if m.startswith("recipe:") else hf_key
                rows.append({"model": m, "dtype": dt, "median_step_s": med, "tokens_per_s": tokens / med,
                             "min_step_s": min(t), "max_step_s": max(t),
                             "ratio_vs_hf": statistics.median([hh / tt for tt, hh in zip(t, times[ref])]),
                             "ratio_vs_hf_cpu_time": statistics.median([hh / tt for tt, hh in
                                                                        zip(cpu[(m, d2)], cpu[ref])])})
    result = {
        "benchmark": "finetune_encoder", "quick": a.quick,
        "config": {**shape, "layers": a.layers, "device": a.device, "dropout": 0.0,
                   "optimizer": f"AdamW(lr=2e-5, wd=0.01), {a.optimizer}" + (
                       " (torch's default: on CPU the per-parameter loop)" if a.optimizer == "default"
                           else ""),
                   "recipe_optimizers": recipe_impls or None,
                   "padding": "row lengths uniform in [seq/2, seq]"},
        "warmup": a.warmup, "repeats": a.repeats, "steps_per_round": a.steps, "rows": rows, "ratios": ratios,
        "bar": 1.2, "first_step_loss": first,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "torch": torch.__version__, "transformers": tf_version,
                    "python": platform.python_version()},
    }
    md = ["| model | dtype | median step (s) | tokens/s | min..max step (s) | vs HF | vs HF, CPU time |",
          "|---|---|---:|---:|---:|---:|---:|",
          *[f"| {r['model']} | {r['dtype']} | {r['median_step_s']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{r['min_step_s']:.3f}..{r['max_step_s']:.3f} | {r['ratio_vs_hf']:.2f}x | "
            f"{r['ratio_vs_hf_cpu_time']:.2f}x |" for r in rows], ""]
    for dt, rr in ratios.items():
        md.append(f"{dt}, same optimizer ({a.optimizer}): qkv / HF throughput, median of per-round ratios "
                  f"**{rr['median']:.2f}x** (range {min(rr['per_round']):.2f}..{max(rr['per_round']):.2f}; "
                  f"in process CPU time {rr['median_cpu_time']:.2f}x; bar 1.2x: "
                  f"{'met' if rr['median'] >= 1.2 else 'NOT met'}).")
        if "recipe" in rr:
            rc = rr["recipe"]
            md.append(f"{dt}, each trainer's AdamW (qkv {recipe_impls['qkv']}, HF {recipe_impls['HF']}) + "
                      f"clipping: qkv / HF **{rc['median']:.2f}x** (range "
                      f"{min(rc['per_round']):.2f}..{max(rc['per_round']):.2f}).")
    md.append(f"{a.layers} layers x hidden {shape['hidden']}, batch {shape['batch']} x seq {shape['seq']}, "
              f"{a.repeats} rounds x {a.steps} steps, {a.warmup} warmup, {a.device}, torch "
              f"{torch.__version__}, transformers {tf_version}, {torch.get_num_threads()} threads, CPU "
              f"capability {torch.backends.cpu.get_cpu_capability()}.")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "finetune_encoder_quick" if a.quick else "finetune_encoder"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out / f"{name}.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    print("\n".join(md))


if __name__ == "__main__":
    main()
