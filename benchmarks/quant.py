"""Weight-only quantization (qkv.nn.quant): what int8 / int4 cost in accuracy and what they buy in decoding
speed.

  accuracy  a character-level GPT (gpt-tiny: 4 layers, 128 wide, context 64) trained here for --steps steps on
            Python's bundled documentation text (the charlm task; a random model's perplexity means nothing),
            then, per variant: perplexity over the held-out 10% of that text, and greedy agreement with the
            fp32 model over --agree-tokens tokens from 4 held-out prompts (the share of equal tokens, and how
            many come before the first difference)
  speed     the 135M Llama shape benchmarks/llm.py builds (random weights; SmolLM-135M's: 30 layers, 576 wide,
            vocab 49152, tied head), loaded by qkv.from_pretrained from an fp32 and a bf16 folder:
            greedy decoding at batch 1, prompt 32, --new tokens, ms per generated token (prefill included,
            as in llm.py), the median of --repeats interleaved repeats at --threads threads; the bytes of
            weights each variant holds; greedy agreement with the fp32 model over the same tokens
Variants: fp32, bf16 (the unquantized models); int8 and int4 on the fp32 model (both compute their products
with bf16-rounded activations on an x86 CPU: the kernels' fast input), int8 and int4 on the bf16 model.

    .venv/bin/python benchmarks/quant.py [--quick] [--threads 2] [--new 48] [--repeats 3] [--steps 300]

--quick: a 2-layer 64-wide Llama, 8 tokens, one repeat, 20 training steps of a 2-layer char model (the smoke
test, tests/benchmarks/test_benchmark_quant.py). Writes benchmarks/results/quant.json and quant.md.
"""

from __future__ import annotations

import argparse
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
from _timing import interleaved, write_results  # noqa: E402
from llm import FULL, QUICK  # noqa: E402  (the 135M Llama shape, and its smoke-test size)
from qkv.generate import generate  # noqa: E402
from qkv.nn.quant import quantize_model, quantized_layers  # noqa: E402

VARIANTS = ("fp32", "bf16", "int8 (fp32 model)", "int4 (fp32 model)", "int8 (bf16 model)",
            "int4 (bf16 model)")


def variant(base: torch.nn.Module, name: str) -> torch.nn.Module:
    """`base` (fp32) as the named variant: a copy, cast and quantized as the name says (layers int4 cannot
    hold become int8: the `layers` column counts each kind)."""
    import copy
    import warnings

    model = copy.deepcopy(base).eval()
    if name == "bf16" or "bf16 model" in name:
        model = model.to(torch.bfloat16)
    mode = name.split()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_model(model, mode) if mode in ("int8", "int4") else model


def layers(model: torch.nn.Module) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in quantized_layers(model).items()) or "-"


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters and buffers (a tied weight once)."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def agreement(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(share of equal tokens, mean count of tokens before the first difference) over the rows."""
    same = got == want
    first = [int(row.logical_not().nonzero()[0]) if not row.all() else row.numel() for row in same]
    return round(same.float().mean().item(), 3), round(sum(first) / len(first), 1)


def train_charlm(steps: int, out: Path, quick: bool) -> Path:
    """A char-level GPT on the pydoc text (the charlm task), trained for `steps` steps: its final
    checkpoint."""
    from qkv.run import load_run_config, train_run

    over = [f"train.max_steps={steps}", "train.progress=false", "train.warmup=30", "eval.n=20",
            "eval.samples=0"]
    if quick:
        over += ["model.preset=gpt-nano", "train.batch_size=8"]
    t0 = time.perf_counter()
    train_run(load_run_config("charlm", over), out=out, quiet=True)
    print(f"trained {out} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out


def accuracy(run: Path, n_tokens: int) -> tuple[list[dict], dict]:
    """Held-out perplexity and greedy agreement with fp32, per variant, of the trained char model."""
    from qkv.run import load_model_any, load_run_task

    task = load_run_task(run)
    base = load_model_any(run).eval()
    val = task.data["val"]
    T = task.options.context
    prompts = torch.stack([val[i:i + T // 2] for i in range(0, 4 * 997, 997)])  # 4 held-out prompts
    rows, want = [], None
    for name in VARIANTS:
        model = variant(base, name)
        ev = task.evaluate(model, n=None)
        with torch.no_grad():  # the char model's context is short: slide over it (the LM task's default)
            out = generate(model, prompts, max_new_tokens=n_tokens, do_sample=False, context_overflow="slide")
        new = out[:, prompts.shape[1]:]
        want = new if want is None else want
        equal, prefix = agreement(new, want)
        rows.append({"variant": name, "perplexity": round(ev["perplexity"], 4), "bpc": round(ev["bpc"], 4),
                     "greedy_equal": equal, "greedy_prefix": prefix, "weight_bytes": weight_bytes(model),
                     "layers": layers(model)})
    meta = {"run": str(run), "val_tokens": int(ev["n_tokens"]), "vocab": task.tokenizer.vocab_size,
            "agree_tokens": n_tokens, "prompts": int(prompts.shape[0])}
    return rows, meta


def speed(spec: dict, a: argparse.Namespace) -> tuple[list[dict], int]:
    """ms per generated token at batch 1 for each variant of a random Llama of shape `spec`; its
    parameters."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec, bos_token_id=1,
                                                                eos_token_id=2)).eval()
    folder = Path(tempfile.mkdtemp(prefix="qkv-quant-bench-"))
    hf.save_pretrained(folder)
    del hf
    base = qkv.from_pretrained(folder).eval()
    n_params = base.num_parameters()
    models = {name: variant(base, name) for name in VARIANTS}
    del base
    x = torch.randint(3, spec["vocab_size"], (1, a.prompt), generator=torch.Generator().manual_seed(1))
    fns = {name: (lambda m=m: generate(m, x, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False))
           for name, m in models.items()}
    with torch.no_grad():
        outs = {k: fn()[:, a.prompt:] for k, fn in fns.items()}  # warm-up, and the tokens compared
        times, _ = interleaved(fns, a.repeats)
    rows = []
    for name in VARIANTS:
        ms = 1000 * statistics.median(times[name]) / a.new
        equal, prefix = agreement(outs[name], outs["fp32"])
        rows.append({"variant": name, "ms_per_token": round(ms, 2),
                     "weight_bytes": weight_bytes(models[name]),
                     "greedy_equal": equal, "greedy_prefix": prefix, "layers": layers(models[name]),
                     "runs_ms": [round(1000 * t / a.new, 2) for t in times[name]]})
    fp32_ms, bf16_ms = rows[0]["ms_per_token"], rows[1]["ms_per_token"]
    for r in rows:
        r["x_fp32"], r["x_bf16"] = (round(fp32_ms / r["ms_per_token"], 2),
                                    round(bf16_ms / r["ms_per_token"], 2))
    return rows, n_params


def table(acc: list[dict], acc_meta: dict, spd: list[dict], meta: dict) -> list[str]:
    lines = [f"trained char GPT ({acc_meta['run']}): held-out perplexity over {acc_meta['val_tokens']} "
             f"tokens; greedy agreement with fp32 over {acc_meta['agree_tokens']} tokens x "
             f"{acc_meta['prompts']} prompts", "",
             "| variant | perplexity | bits/char | greedy equal | tokens before 1st diff | weights MB | "
             "layers |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['perplexity']} | {r['bpc']} | {r['greedy_equal']} | "
              f"{r['greedy_prefix']} | {r['weight_bytes'] / 1e6:.2f} | {r['layers']} |" for r in acc]
    lines += ["",
              f"Llama {meta['model_params'] / 1e6:.1f}M shape (random weights), batch 1, prompt "
              f"{meta['prompt']}, {meta['new_tokens']} new tokens (greedy), {meta['threads']} threads, "
              f"median of {meta['repeats']} interleaved repeats; CPU {meta['cpu_capability']}", "",
              "| variant | ms/token | x fp32 | x bf16 | weights MB | greedy equal to fp32 | tokens before "
              "1st diff | layers |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['ms_per_token']} | {r['x_fp32']} | {r['x_bf16']} | "
              f"{r['weight_bytes'] / 1e6:.1f} | {r['greedy_equal']} | {r['greedy_prefix']} | {r['layers']} |"
                  for r in spd]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny models, a few tokens (smoke test)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=48, help="tokens generated per timed decode")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300, help="training steps of the char model")
    ap.add_argument("--agree-tokens", type=int, default=100,
                    help="greedy tokens compared per prompt (char model)")
    ap.add_argument("--run", default=None,
                    help="reuse this trained charlm run folder instead of training one")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args()
    if a.quick:
        a.new, a.repeats, a.steps, a.agree_tokens = 8, 1, 20, 16
    torch.set_num_threads(a.threads)
    spec = QUICK if a.quick else FULL
    t0 = time.perf_counter()
    run = (Path(a.run) if a.run
           else train_charlm(a.steps, Path(tempfile.mkdtemp(prefix="qkv-quant-charlm-")), a.quick))
    acc, acc_meta = accuracy(run, a.agree_tokens)
    spd, n_params = speed(spec, a)
    meta = {"torch": torch.__version__, "threads": a.threads,
            "machine": platform.processor() or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "quick": a.quick, "model": spec,
            "model_params": n_params, "prompt": a.prompt, "new_tokens": a.new, "repeats": a.repeats,
            "train_steps": a.steps, "seconds": round(time.perf_counter() - t0, 1),
            "note": "shared, loaded machine: medians of interleaved repeats; compare ratios within this run"}
    write_results(a.out, "quant_quick" if a.quick else "quant",
                  {"meta": meta, "accuracy": {"meta": acc_meta, "rows": acc}, "decode": spd},
                  table(acc, acc_meta, spd, meta))


if __name__ == "__main__":
    main()
