"""Training throughput on CPU: qkv GPT vs nanoGPT's model vs Hugging Face GPT2LMHeadModel, fp32 and bf16.

One training step = forward with the next-token loss + backward + AdamW step + zero_grad. The model: GPT
n_layer 6, n_head 6, n_embd 384, block 256, vocab 65 (nanoGPT's shakespeare_char size), batch 8, dropout 0,
biases on (GPT-2). bf16 = `torch.autocast("cpu", dtype=torch.bfloat16)` around the forward, fp32 weights and
optimizer (the same for all three).

Same weights: a Hugging Face GPT2LMHeadModel is built with random weights and saved to a temporary folder;
qkv loads it with `qkv.from_pretrained`, nanoGPT's GPT takes the same state dict the way nanoGPT's own
`GPT.from_pretrained` does (Conv1D weights transposed, the attention-mask buffers skipped). The three see the
same batches, and their fp32 first-step losses are printed and written: equal losses show that the three
compute the same function. nanoGPT's loss is given shifted targets (last position ignored), which is what
HF and qkv do with labels=input_ids.

nanoGPT's `model.py` is NOT part of qkv: pass the path of a copy you have (`--nanogpt PATH/model.py`, e.g. a
clone of https://github.com/karpathy/nanoGPT); it is loaded with importlib, never downloaded.

Two comparisons in one run:
- The MODEL comparison (rows "qkv GPT", "nanoGPT GPT", "HF ...", "qkv GPT, exact GELU"): every model trains
  with the same `torch.optim.AdamW` (`--optimizer`: torch's default, which on CPU is the per-parameter loop;
  foreach; fused), no clipping: only the models differ.
- The RECIPE comparison (rows starting "recipe:", `--no-recipes` to skip): each project's training step with
  the optimizer its own code builds, as its training loop runs it (LR set per step, forward, backward,
  clip_grad_norm_(1.0), AdamW step, zero_grad), on the same weights and batches:
  "recipe: nanoGPT loop" = nanoGPT's model with the AdamW of its `configure_optimizers(0.1, 3e-4, (0.9, 0.95),
  "cpu")` (fused on CUDA only, so torch's default loop here), the step of nanoGPT's train.py;
  "recipe: qkv loop" = qkv's model with the AdamW `qkv.train.Trainer` builds (`build_optimizer`,
  optimizer_impl auto: fused on CPU), the same bare step; "recipe: qkv Trainer.fit" = `qkv.train.Trainer`
  itself (fp32 or bf16 autocast, clip 1.0, logging every 10 steps, no progress bar): a fresh Trainer per
  round runs `--steps` + 1 updates and the per-update time of the last `--steps` is taken between its
  on_step_start callbacks and after the last on_step_end (the Trainer's final checkpoint is outside the timed
  part). Trainer overhead = time(Trainer.fit step) / time(qkv loop step) - 1 (bar: <= 5%).

Timing: in one process, `--warmup` steps each, then `--rounds` rounds; in each round every (model, precision)
pair runs `--steps` steps, the order reversed every other round (ABC..CBA), so load from other jobs on a
shared machine hits all alike. Reported: the median tokens/s of each pair, and the medians (with min..max)
of the per-round ratios qkv/nanoGPT, qkv/HF and bf16/fp32. Bar: qkv >= 1.1x nanoGPT's model in
both precisions.

    .venv/bin/python benchmarks/train_vs_nanogpt.py --nanogpt PATH/model.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

import qkv  # noqa: E402
from _timing import interleaved  # noqa: E402

FULL = dict(n_layer=6, n_head=6, n_embd=384, block=256, batch=8, vocab=65)
QUICK = dict(n_layer=2, n_head=2, n_embd=64, block=32, batch=2, vocab=65)
RECIPE_NANO = "recipe: nanoGPT loop, its configure_optimizers AdamW"
RECIPE_QKV = "recipe: qkv loop, Trainer's AdamW"
RECIPE_QKV_OLD = "recipe: qkv loop, torch's default AdamW"
RECIPE_TRAINER = "recipe: qkv Trainer.fit"
MODELS = ("qkv GPT", "nanoGPT GPT", "HF GPT2LMHeadModel (sdpa)", "qkv GPT, exact GELU")
# GPT-2 (and so qkv's GPT-2 model and HF's) uses the tanh approximation of GELU; nanoGPT's model the exact erf
# form, whose CPU kernel is ~2x faster here. The last row is qkv computing nanoGPT's exact function.
PRECISIONS = ("fp32", "bf16")
BAR = 1.1


def fail(msg: str) -> None:
    """One line on stderr, exit status 2 (as argparse and the qkv CLI do)."""
    print(f"train_vs_nanogpt: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def load_nanogpt(path: str) -> ModuleType:
    """nanoGPT's model.py as a module; exit 2 with one clear line when it is missing or unusable."""
    p = Path(path)
    if not p.is_file():
        fail(f"--nanogpt {path}: no such file (give the path of nanoGPT's model.py, e.g. from a clone of "
             "https://github.com/karpathy/nanoGPT; it is never downloaded)")
    spec = importlib.util.spec_from_file_location("nanogpt_model", p)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a broken or foreign file: say which, without a traceback
        fail(f"--nanogpt {path}: cannot be loaded: {type(e).__name__}: {e}")
    if not (hasattr(module, "GPT") and hasattr(module, "GPTConfig")):
        fail(f"--nanogpt {path}: defines no GPT / GPTConfig (not nanoGPT's model.py)")
    return module


def build_models(nanogpt: ModuleType, s: dict, seed: int = 0):
    """(qkv, nanoGPT, HF, qkv exact GELU) models, same weights, train mode, and the transformers version."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=s["vocab"], n_positions=s["block"], n_embd=s["n_embd"], n_layer=s["n_layer"],
                     n_head=s["n_head"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0, attn_implementation="sdpa")
    hf = GPT2LMHeadModel(cfg)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = qkv.from_pretrained(d)
    exact = GPT2LMHeadModel(GPT2Config(**{**cfg.to_dict(), "activation_function": "gelu"}))
    exact.load_state_dict(hf.state_dict())
    with tempfile.TemporaryDirectory() as d:
        exact.save_pretrained(d)
        ours_exact = qkv.from_pretrained(d)
    ncfg = nanogpt.GPTConfig(block_size=s["block"], vocab_size=s["vocab"], n_layer=s["n_layer"],
                             n_head=s["n_head"], n_embd=s["n_embd"], dropout=0.0, bias=True)
    with contextlib.redirect_stdout(io.StringIO()):  # nanoGPT prints its parameter count
        nano = nanogpt.GPT(ncfg)
    # as nanoGPT's GPT.from_pretrained: HF's Conv1D stores (in, out), nn.Linear (out, in)
    transposed = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    sd_hf = {k: v for k, v in hf.state_dict().items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    sd = nano.state_dict()
    keys = [k for k in sd if not k.endswith(".attn.bias")]  # nanoGPT's causal-mask buffer (non-flash path)
    if sorted(keys) != sorted(sd_hf):
        fail(f"nanoGPT's state dict does not match GPT-2's: {sorted(set(keys) ^ set(sd_hf))[:6]}")
    with torch.no_grad():
        for k in keys:
            sd[k].copy_(sd_hf[k].t() if k.endswith(transposed) else sd_hf[k])
    return ours.train(), nano.train(), hf.train(), ours_exact.train(), transformers.__version__


OPTIMIZERS = {  # the AdamW implementation, the same for every model
    # torch's default: on CPU neither foreach nor fused, the per-parameter loop (what nanoGPT's
    # configure_optimizers gives on CPU too: it asks for fused=True on CUDA only)
    "default": {},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def nanogpt_recipe_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer | None:
    """The AdamW nanoGPT's own code builds for this model on CPU (train.py's defaults: wd 0.1, betas
    (0.9, 0.95)); None when the model.py given has no configure_optimizers."""
    if not hasattr(model, "configure_optimizers"):
        return None
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its group sizes and "using fused AdamW"
        return model.configure_optimizers(weight_decay=0.1, learning_rate=3e-4, betas=(0.9, 0.95),
                                          device_type="cpu")


def make_recipe_step(kind: str, model: torch.nn.Module, precision: str, opt: torch.optim.Optimizer):
    """nanoGPT train.py's step (LR set per group, forward under autocast, backward, clip_grad_norm_(1.0),
    AdamW step, zero_grad) with `opt`: each project's optimizer as its own code builds it."""
    def step(x: torch.Tensor) -> float:
        for g in opt.param_groups:
            g["lr"] = 3e-4  # the schedule's value; nanoGPT sets it every iteration
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
        with ctx:
            if kind == "nanoGPT GPT":
                targets = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -1)], dim=1)
                _, loss = model(x, targets)
            else:
                loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


class _Batches:
    """The benchmark's batches as a qkv batch source (labels = input_ids: the model shifts them)."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.batches = batches

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, torch.Tensor]:
        x = self.batches[index % len(self.batches)]
        return {"input_ids": x, "labels": x}


class TrainerSteps:
    """`qkv.train.Trainer.fit` as a timed contender: each call runs a fresh Trainer (a new AdamW, as the
    Trainer builds it) on the same model for n + 1 updates and returns the mean time of the last n, measured
    from the on_step_start of update 2 to the on_step_end of the last (everything the Trainer does per update:
    batch, forward, token-normalised backward, grad norm, clipping, AdamW, zero_grad, the metrics record).
    With log_every 10 and n + 1 < 10 no timed update appends a line to metrics.jsonl (update 1 does): that
    one small file append every 10 updates is left out."""

    def __init__(self, model: torch.nn.Module, precision: str, batches: list[torch.Tensor],
                 out_dir: str) -> None:
        from qkv.train import LambdaCallback, TrainConfig, Trainer

        self.model, self.precision, self.data, self.out_dir = model, precision, _Batches(batches), out_dir
        self.Trainer, self.TrainConfig, self.LambdaCallback = Trainer, TrainConfig, LambdaCallback
        self.batch_size = batches[0].shape[0]
        self.impl: str | None = None

    def __call__(self, n: int) -> tuple[float, float]:
        """(wall s, process CPU s) per update."""
        marks: dict[str, tuple[float, float]] = {}
        now = lambda: (time.perf_counter(), time.process_time())  # noqa: E731
        def end(tr, step: int, rec: dict) -> None:
            if step == n + 1:  # the clocks are read at the two ends only, as for the other rows
                marks["t1"] = now()
                tr.should_stop = True  # (set after the step's logging: no extra record)

        cb = self.LambdaCallback(
            on_step_start=lambda tr, step: marks.setdefault("t0", now()) if step == 2 else None,
            on_step_end=end)
        # max_steps far away, so that no timed update is the last one (which always writes a metrics record);
        # the constant schedule makes the LR independent of it
        cfg = self.TrainConfig(max_steps=1_000_000, batch_size=self.batch_size, lr=3e-4, betas=[0.9, 0.95],
                               weight_decay=0.1, schedule="constant", warmup=0, clip_grad=1.0,
                               precision=self.precision, device="cpu", distributed="none", progress=False,
                               tensorboard=False, plot=False, save_every=0, keep_last=1, out_dir=self.out_dir)
        # each round is a fresh run: drop the previous round's final checkpoint (the Trainer refuses a fresh
        # run in a folder holding another run's checkpoints)
        shutil.rmtree(os.path.join(self.out_dir, "checkpoints"), ignore_errors=True)
        tr = self.Trainer(self.model, cfg, self.data, callbacks=[cb])
        self.impl = tr.optimizer_impl
        with contextlib.redirect_stderr(io.StringIO()):  # its run log
            tr.fit()
        return (marks["t1"][0] - marks["t0"][0]) / n, (marks["t1"][1] - marks["t0"][1]) / n


def optimizer_update_ms(model: torch.nn.Module, rounds: int) -> dict[str, float]:
    """The AdamW update alone (opt.step() on fixed random gradients, qkv's two decay groups) per
    implementation, interleaved over `rounds` rounds after 2 warm-up updates: median milliseconds."""
    from qkv.train import build_optimizer

    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    opts = {impl: build_optimizer(m, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, impl=impl)[0]
            for impl in ("loop", "foreach", "fused")}
    steps = {k: opt.step for k, opt in opts.items()}
    interleaved(steps, 2)  # warm-up updates
    times, _ = interleaved(steps, rounds)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def make_step(kind: str, model: torch.nn.Module, precision: str, optimizer: str = "default"):
    """One optimizer step of `model` on a batch x (B, T): the next-token loss over positions 0..T-2."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95),
                            **OPTIMIZERS[optimizer])

    def step(x: torch.Tensor) -> float:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
        with ctx:
            if kind == "nanoGPT GPT":
                targets = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -1)], dim=1)  # -1: ignore_index
                _, loss = model(x, targets)
            else:
                loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def ratio_stats(num: list[float], den: list[float]) -> dict:
    """Per-round throughput ratio num/den from per-step times (den_time / num_time)."""
    r = [d / n for n, d in zip(num, den)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r), "per_round": r}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanogpt", required=True, metavar="PATH",
                    help="path of nanoGPT's model.py (not shipped)")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny model, 1 warmup step, 2 rounds of 1 step (smoke)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=2, help="steps per (model, precision) per round")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--optimizer", default="default", choices=list(OPTIMIZERS),
                    help="AdamW implementation for every model: torch's default (on CPU the per-parameter "
                         "loop), foreach or fused")
    ap.add_argument("--no-recipes", dest="recipes", action="store_false",
                    help="skip the rows of each project's own recipe (its optimizer, clipping, Trainer.fit)")
    ap.add_argument("--only-recipes", action="store_true",
                    help="only the recipe rows (more rounds in the same time for the optimizer / Trainer "
                         "figures)")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args(argv)
    precisions = [p for p in a.precisions.split(",") if p]
    if not set(precisions) <= set(PRECISIONS) or not precisions:
        ap.error(f"--precisions: a comma-separated subset of {','.join(PRECISIONS)}")
    nanogpt = load_nanogpt(a.nanogpt)
    s = QUICK if a.quick else FULL
    if a.quick:
        a.warmup, a.rounds, a.steps = 1, 2, 1
    if a.threads:
        torch.set_num_threads(a.threads)

    ours, nano, hf, ours_exact, tf_version = build_models(nanogpt, s)
    base = dict(zip(MODELS, (ours, nano, hf, ours_exact)))
    models = () if a.only_recipes else MODELS
    steps = {(m, p): make_step(m, base[m] if i == 0 else copy.deepcopy(base[m]), p, a.optimizer)
             for i, p in enumerate(precisions) for m in models}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, s["vocab"], (s["batch"], s["block"]), generator=g) for _ in range(4)]
    tokens = s["batch"] * s["block"]

    # each project's own recipe (module docstring), every contender on its own copy of the same weights
    tmp = tempfile.TemporaryDirectory()
    trainers: dict[tuple, TrainerSteps] = {}
    notes: list[str] = []
    if a.recipes:
        from qkv.train import build_optimizer, param_groups
        from qkv.train.optim import implementation

        for p in precisions:
            nano_m = copy.deepcopy(nano)
            nano_opt = nanogpt_recipe_optimizer(nano_m)
            if nano_opt is None:
                notes.append("nanoGPT recipe skipped: the model.py given has no GPT.configure_optimizers")
            else:
                steps[(RECIPE_NANO, p)] = make_recipe_step("nanoGPT GPT", nano_m, p, nano_opt)
            q = copy.deepcopy(ours)
            q_opt, _ = build_optimizer(q, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
            steps[(RECIPE_QKV, p)] = make_recipe_step("qkv GPT", q, p, q_opt)
            q_old = copy.deepcopy(ours)  # torch's default AdamW (CPU: a loop over the parameters)
            q_old_opt = torch.optim.AdamW(param_groups(q_old, 0.1)[0], lr=3e-4, betas=(0.9, 0.95))
            steps[(RECIPE_QKV_OLD, p)] = make_recipe_step("qkv GPT", q_old, p, q_old_opt)
            trainers[(RECIPE_TRAINER, p)] = TrainerSteps(copy.deepcopy(ours), p, batches, f"{tmp.name}/{p}")
            impls = {"nanoGPT recipe": implementation(nano_opt) if nano_opt is not None else None,
                     "qkv recipe (Trainer's build_optimizer)": implementation(q_opt),
                     "qkv torch default": implementation(q_old_opt)}
    else:
        impls = {}

    # the first step of every pair on the same batch from the same weights: same function, same loss (fp32)
    first = {f"{m} {p}": fn(batches[0]) for (m, p), fn in steps.items()}
    print("first-step loss: " + ", ".join(f"{k} {v:.6f}" for k, v in first.items()), flush=True)
    for fn in steps.values():
        for i in range(a.warmup - 1):
            fn(batches[(i + 1) % len(batches)])
    for tr in trainers.values():
        tr(1)

    def timed(fn):  # n steps of a step function -> (wall s, CPU s) per step
        def run(n: int) -> tuple[float, float]:
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(n):
                fn(batches[i % len(batches)])
            return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n
        return run

    contenders = {k: timed(fn) for k, fn in steps.items()}
    contenders.update(trainers)
    times: dict[tuple, list[float]] = {k: [] for k in contenders}
    cpu: dict[tuple, list[float]] = {k: [] for k in contenders}
    order = list(contenders)
    for r in range(a.rounds):
        for key in (order if r % 2 == 0 else order[::-1]):
            wall, c = contenders[key](a.steps)
            times[key].append(wall)
            cpu[key].append(c)
        print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{m} {p} {tokens / times[(m, p)][-1]:.0f}"
                                                       for m, p in order) + " tok/s", flush=True)
    tmp.cleanup()
    update_ms = optimizer_update_ms(ours, 3 if a.quick else 5 * a.rounds) if a.recipes else {}

    def ref_of(m: str, p: str) -> tuple | None:  # the nanoGPT row a row is compared with
        key = (RECIPE_NANO if m.startswith("recipe:") else "nanoGPT GPT", p)
        return key if key in times else None

    rows = []
    for m, p in order:
        med = statistics.median(times[(m, p)])
        hf_key = ("HF GPT2LMHeadModel (sdpa)", p)
        rows.append({"model": m, "precision": p, "median_step_s": med, "tokens_per_s": tokens / med,
                     "min_step_s": min(times[(m, p)]), "max_step_s": max(times[(m, p)]),
                     "median_cpu_s_per_step": statistics.median(cpu[(m, p)]),
                     "vs_nanogpt": ratio_stats(times[(m, p)], times[ref_of(m, p)])["median"] if ref_of(m, p)
                         else None,
                     "vs_hf": None if m.startswith("recipe:")
                         else ratio_stats(times[(m, p)], times[hf_key])["median"],
                     "bf16_over_fp32": (ratio_stats(times[(m, "bf16")], times[(m, "fp32")])["median"]
                                        if p == "bf16" and "fp32" in precisions else None)})
    ratios = {} if a.only_recipes else {p: {"qkv/nanoGPT": ratio_stats(times[("qkv GPT", p)],
                                                                       times[("nanoGPT GPT", p)]),
                  "qkv/HF": ratio_stats(times[("qkv GPT", p)], times[("HF GPT2LMHeadModel (sdpa)", p)]),
                  "qkv exact GELU/nanoGPT": ratio_stats(times[("qkv GPT, exact GELU", p)],
                                                        times[("nanoGPT GPT", p)])}
              for p in precisions}
    recipe: dict[str, dict] = {}
    for p in precisions if a.recipes else ():
        rp = recipe[p] = {}
        if (RECIPE_NANO, p) in times:
            rp["qkv Trainer.fit/nanoGPT recipe"] = ratio_stats(times[(RECIPE_TRAINER, p)],
                                                               times[(RECIPE_NANO, p)])
            rp["qkv loop/nanoGPT recipe"] = ratio_stats(times[(RECIPE_QKV, p)], times[(RECIPE_NANO, p)])
        rp["qkv loop/torch default AdamW"] = ratio_stats(times[(RECIPE_QKV, p)], times[(RECIPE_QKV_OLD, p)])
        # in process CPU time too: less moved by other jobs on a shared machine than wall time
        rp["qkv loop/torch default AdamW, CPU time"] = ratio_stats(cpu[(RECIPE_QKV, p)],
                                                                   cpu[(RECIPE_QKV_OLD, p)])
        over_cpu = [t / b - 1 for t, b in zip(cpu[(RECIPE_TRAINER, p)], cpu[(RECIPE_QKV, p)])]
        rp["trainer_overhead_cpu_time"] = {"median": statistics.median(over_cpu), "per_round": over_cpu}
        over = [t / b - 1 for t, b in zip(times[(RECIPE_TRAINER, p)], times[(RECIPE_QKV, p)])]
        rp["trainer_overhead"] = {"median": statistics.median(over), "min": min(over), "max": max(over),
                                  "per_round": over}
    meets = None if a.only_recipes else all(ratios[p]["qkv/nanoGPT"]["median"] >= BAR for p in precisions)
    machine = {"cpu": platform.processor() or platform.machine(),
               "capability": torch.backends.cpu.get_cpu_capability(),
               "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": tf_version,
               "python": platform.python_version()}
    result = {"benchmark": "train_vs_nanogpt", "quick": a.quick,
              "config": {**s, "dropout": 0.0, "bias": True, "device": "cpu",
                         "optimizer": f"AdamW(lr=3e-4, wd=0.1, betas=(0.9, 0.95)), {a.optimizer}"
                                      + (" (torch's default: on CPU the per-parameter loop)"
                                             if a.optimizer == "default"
                                         else "")},
              "nanogpt_path": str(Path(a.nanogpt).resolve()), "warmup": a.warmup, "rounds": a.rounds,
              "steps_per_round": a.steps, "rows": rows, "ratios": ratios, "bar": BAR, "meets_bar": meets,
              "first_step_loss": first, "machine": machine,
              "recipes": {"ratios": recipe, "optimizers": impls, "notes": notes,
                          "adamw_update_ms": update_ms} if a.recipes else None}

    def fmt(x: float | None) -> str:
        return "" if x is None or x != x else f"{x:.2f}x"  # x != x: NaN

    md = [f"Model comparison: every model with the same AdamW ({a.optimizer}"
          + (": torch's default, on CPU the per-parameter loop" if a.optimizer == "default" else "")
          + ", no clipping). Rows \"recipe: ...\": each project's own step with the optimizer its code builds"
          + (f" ({', '.join(f'{k}: {v}' for k, v in impls.items())})" if impls else "")
          + ", LR set + clip_grad_norm_(1.0) per step; their \"vs nanoGPT\" is against nanoGPT's recipe row.",
          "", "| row | precision | median step (s) | tokens/s | min..max step (s) | CPU s/step | vs nanoGPT "
              "| vs HF | bf16 / fp32 |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cpu_s = r["median_cpu_s_per_step"]
        md.append(f"| {r['model']} | {r['precision']} | {r['median_step_s']:.3f} | {r['tokens_per_s']:.0f} | "
                  f"{r['min_step_s']:.3f}..{r['max_step_s']:.3f} | "
                  f"{'' if cpu_s != cpu_s else f'{cpu_s:.3f}'} | {fmt(r['vs_nanogpt'])} | {fmt(r['vs_hf'])} "
                  f"| {fmt(r['bf16_over_fp32'])} |")
    md.append("")
    for p in precisions:
        if p in ratios:
            n, h = ratios[p]["qkv/nanoGPT"], ratios[p]["qkv/HF"]
            e = ratios[p]["qkv exact GELU/nanoGPT"]
            md.append(f"{p}, same optimizer: qkv / nanoGPT **{n['median']:.2f}x** (per-round range "
                      f"{n['min']:.2f}..{n['max']:.2f}), qkv / HF {h['median']:.2f}x "
                      f"({h['min']:.2f}..{h['max']:.2f}); with nanoGPT's exact GELU, qkv / nanoGPT "
                      f"{e['median']:.2f}x ({e['min']:.2f}..{e['max']:.2f}).")
        if p in recipe:
            rp = recipe[p]
            parts = [f"{p}, each recipe:"]
            if "qkv Trainer.fit/nanoGPT recipe" in rp:
                t, b = rp["qkv Trainer.fit/nanoGPT recipe"], rp["qkv loop/nanoGPT recipe"]
                parts.append(f"qkv Trainer.fit / nanoGPT **{t['median']:.2f}x** "
                             f"({t['min']:.2f}..{t['max']:.2f}), qkv loop / nanoGPT {b['median']:.2f}x "
                             f"({b['min']:.2f}..{b['max']:.2f});")
            o, ov = rp["qkv loop/torch default AdamW"], rp["trainer_overhead"]
            oc, ovc = rp["qkv loop/torch default AdamW, CPU time"], rp["trainer_overhead_cpu_time"]
            parts.append(f"qkv's Trainer AdamW / torch's default {o['median']:.2f}x "
                         f"({o['min']:.2f}..{o['max']:.2f}; in process CPU time {oc['median']:.2f}x); "
                         f"Trainer.fit overhead over the bare qkv loop **{ov['median'] * 100:+.1f}%** "
                         f"({ov['min'] * 100:+.1f}..{ov['max'] * 100:+.1f}%; in CPU time "
                         f"{ovc['median'] * 100:+.1f}%; bar <= 5%).")
            md.append(" ".join(parts))
    if update_ms:
        md.append("AdamW update alone on qkv's parameters (opt.step(), median ms): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in update_ms.items()) + ".")
    md += [*notes, "",
           f"Medians of per-round ratios over {a.rounds} interleaved rounds x {a.steps} steps "
           f"({a.warmup} warmup). "
           + (f"Bar: qkv >= {BAR}x nanoGPT (same optimizer) in {' and '.join(precisions)}: "
              f"{'met' if meets else 'NOT met'}. " if meets is not None else "")
           + "fp32 first-step losses: " + ", ".join(f"{k[:-5]} {v:.6f}" for k, v in first.items()
                                                    if k.endswith(" fp32")) + ".",
           f"torch {torch.__version__} (CPU capability {machine['capability']}), transformers {tf_version}, "
           f"{machine['threads']} threads, {machine['cpu']}."]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "train_vs_nanogpt_quick" if a.quick else "train_vs_nanogpt"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out / f"{stem}.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    print("\n".join(md))


if __name__ == "__main__":
    main()
