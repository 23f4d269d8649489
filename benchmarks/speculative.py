"""Speculative decoding on a CPU at batch 1: what one verifying forward costs, and what it buys.

Two measurements, side by side in one run (interleaved rounds, medians):
  verify   ms of one target forward over n = 1, 2, 4, 8, 11 new tokens after a 64-token cache
           (model.verify, the cache cropped back after each): the price of checking n - 1 drafts,
           independent of the weights' values. Speculation pays when accepted tokens per forward + 1 exceed
           the ratio to n = 1.
  decode   greedy decoding of --new tokens, plain vs prompt lookup (--k drafts) vs an assistant model
           (--draft FOLDER), on two tasks: "rewrite" (the prompt is a paragraph to copy with corrections:
           the answer repeats long spans of it) and "free" (a short open prompt). tok/s, speed-up over
           plain, acceptance rate (accepted / drafted), and whether the tokens equal plain greedy's.
  engine   the serving Engine (continuous batching over the paged KV cache, `qkv serve`'s) on the rewrite
           task at batch 1 and 4 (four prompts that differ in their first token), speculation off vs
           EngineConfig(speculative="prompt-lookup", speculative_tokens=--k) ("on") vs, with --draft, the
           draft model drafting --draft-k tokens per step for every request (Engine(draft_model=...),
           `qkv serve --speculative FOLDER`): tok/s of the whole batch, the ratio, the acceptance rate, and
           whether the tokens equal the engine's without speculation. Prefix caching off, so every round
           computes its prompts.

Model: --folder (a Hugging Face folder with its tokenizer.json: the tasks are real text), else SmolLM-135M's
shape with random weights (benchmarks/llm.py's FULL; --quick: a 2-layer width-64 one) and token-id tasks: the
paragraph is random ids and the "rewrite" prompt holds it twice, so lookup finds spans to draft. On random
weights the acceptance rates are not a trained model's (the model neither copies nor continues text): read
the verify table for the cost, a real folder for the acceptance. The machine is shared: compare ratios.

    .venv/bin/python benchmarks/speculative.py [--folder F] [--draft F|same] [--draft-k 5] [--quick]
        [--threads 2] [--new 64] [--k 10] [--repeats 3] [--dtype float32] [--parts verify,decode,engine]

--draft same: the model drafts for itself (acceptance ~1, a draft step as dear as the target's: the cost of
the drafting machinery, not a draft model's gain). --draft cut:N (random weights only): the random model's
layers past the N-th are damped (output projections x 0.02) and its first N layers, with the same embeddings,
norm and head, are the draft: a pair that agrees on most tokens, as a trained small draft of the same family
does, for the cost of N layers and the head per draft token.

Writes benchmarks/results/speculative.json and speculative.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

import qkv  # noqa: E402
from _timing import interleaved, write_results  # noqa: E402
from llm import FULL, QUICK  # noqa: E402
from qkv.generate import Engine, generate  # noqa: E402

PARAGRAPH = (
    "The key-value cache keeps the keys and values of every token that the model has already seen, so that "
    "each new token only computes its own. At batch one the decoding step reads every weight of the model "
    "once and does little arithmetic with it: the time of a step is the time it takes to read the weights "
    "from memory. Speculative decoding uses that slack. A cheap drafter proposes a few tokens, and the model "
    "checks all of them in a single forward pass, which reads the weights only once.")
REWRITE = ("Rewrite this paragraph, correcting any mistakes, and keep everything else as it is:\n\n{}\n\n"
           "Rewritten:\n")
FREE = "Write a short story about a lighthouse keeper who finds a message in a bottle.\n\n"
VERIFY_WIDTHS = (1, 2, 4, 8, 11)
DAMP = 0.02  # --draft cut:N: the scale of the output projections of the random model's layers past N


def build_random(quick: bool, dtype: torch.dtype, tmp: Path, cut: int | None = None) -> Path:
    """A random Llama folder. cut=N: the layers past the N-th add little (their output projections scaled by
    DAMP), and TMP/draft holds its first N layers with the same embeddings, norm and head: a draft that agrees
    with the model on most tokens, as a trained small model of the same family would, at the cost of N layers
    and the head."""
    import transformers

    torch.manual_seed(0)
    spec = QUICK if quick else FULL
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec, bos_token_id=1,
                                                                eos_token_id=2)).to(dtype).eval()
    if cut is not None:
        with torch.no_grad():
            for layer in hf.model.layers[cut:]:
                layer.self_attn.o_proj.weight.mul_(DAMP)
                layer.mlp.down_proj.weight.mul_(DAMP)
        small = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **{**spec, "num_hidden_layers": cut}, bos_token_id=1, eos_token_id=2)).to(dtype).eval()
        small.load_state_dict(hf.state_dict(), strict=False)  # the first `cut` layers, embeddings, norm
        small.save_pretrained(tmp / "draft")
    hf.save_pretrained(tmp / "random")
    return tmp / "random"


def prompts(folder: Path, vocab: int) -> dict[str, torch.Tensor]:
    """The two tasks' prompt ids: real text through the folder's tokenizer, else random ids."""
    from qkv.run import hf_folder_tokenizer

    tok = hf_folder_tokenizer(folder)
    if tok is not None:
        return {"rewrite": torch.tensor([tok.encode(REWRITE.format(PARAGRAPH))]),
                "free": torch.tensor([tok.encode(FREE)])}
    g = torch.Generator().manual_seed(0)
    para = torch.randint(3, vocab, (1, 96), generator=g)
    head = torch.randint(3, vocab, (1, 16), generator=g)
    return {"rewrite": torch.cat([head, para, head[:, :4], para[:, :8]], 1),
            "free": torch.randint(3, vocab, (1, 24), generator=g)}


def verify_costs(model, repeats: int) -> dict[int, float]:
    """Median ms of model.verify over n new tokens after a 64-token cache."""
    vocab = model.output_vocab_size
    cache = model.make_cache(1, 128)
    with torch.no_grad():
        model.prefill(torch.randint(0, vocab, (1, 64)), cache)

        def run(n: int):
            def fn():
                model.verify(torch.randint(0, vocab, (1, n)), cache, n_logits=n)
                cache.crop(64)
            return fn

        times, _ = interleaved({n: run(n) for n in VERIFY_WIDTHS}, repeats + 2)
    return {n: 1000 * statistics.median(t[2:]) for n, t in times.items()}


def decode_rows(model, draft, ids: dict[str, torch.Tensor], new: int, k: int, repeats: int) -> list[dict]:
    rows = []
    opts = dict(max_new_tokens=new, eos_token_id=[], do_sample=False, return_dict=True)
    for task, x in ids.items():
        fns = {"plain": lambda x=x: generate(model, x, **opts),
               f"prompt lookup k={k}": lambda x=x: generate(model, x, prompt_lookup_num_tokens=k, **opts)}
        if draft is not None:
            fns["assistant"] = lambda x=x: generate(model, x, assistant_model=draft, **opts)
        times, last = interleaved(fns, repeats)
        base = statistics.median(times["plain"])
        for name, t in times.items():
            spec = last[name].speculation
            rows.append({"task": task, "prompt_tokens": x.shape[1], "method": name,
                         "tok_s": new / statistics.median(t), "speedup": base / statistics.median(t),
                         "acceptance": None if spec is None else spec.acceptance_rate,
                         "tokens_per_forward": None if spec is None else new / max(1, spec.forwards),
                         "equal_to_plain": bool(torch.equal(last[name].sequences, last["plain"].sequences))})
    return rows


def engine_rows(model, draft, rewrite: torch.Tensor, new: int, k: int, draft_k: int,
                repeats: int) -> list[dict]:
    """The Engine at batch 1 and 4 on the rewrite task, speculation off vs prompt lookup vs the draft model
    (interleaved rounds)."""
    rows = []
    base = rewrite[0].tolist()
    for batch in (1, 4):
        prompts = [[3 + i] + base for i in range(batch)]  # distinct first blocks: nothing shared
        engines = {"off": Engine(model, prefix_caching=False, max_batch_size=batch),
                   "on": Engine(model, prefix_caching=False, max_batch_size=batch,
                                speculative="prompt-lookup", speculative_tokens=k)}
        if draft is not None:
            engines["draft model"] = Engine(model, prefix_caching=False, max_batch_size=batch,
                                            draft_model=draft, speculative_tokens=draft_k)

        def run(engine, prompts=prompts):
            def fn():
                before = (engine.speculation.drafted, engine.speculation.accepted)
                ids = [engine.add_request(p, max_new_tokens=new, eos_token_id=[]) for p in prompts]
                out = engine.run()
                drafted = engine.speculation.drafted - before[0]
                accepted = engine.speculation.accepted - before[1]
                return [out[i] for i in ids], (accepted / drafted if drafted else None)
            return fn

        times, last = interleaved({name: run(e) for name, e in engines.items()}, repeats)
        off = statistics.median(times["off"])
        for name, t in times.items():
            rows.append({"batch": batch, "prompt_tokens": len(prompts[0]), "speculation": name,
                         "tok_s": batch * new / statistics.median(t), "speedup": off / statistics.median(t),
                         "acceptance": last[name][1], "equal_to_off": last[name][0] == last["off"][0]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", default=None, help="a Hugging Face model folder (default: random weights)")
    ap.add_argument("--draft", default=None, help="an assistant model folder of the same tokenizer ('same': "
                    "the model itself; 'cut:N': random weights whose layers past N add little, drafted by "
                    "their first N layers)")
    ap.add_argument("--draft-k", type=int, default=5, help="tokens the Engine's draft model drafts per step")
    ap.add_argument("--quick", action="store_true", help="a tiny random model, few tokens (smoke test)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--parts", default="verify,decode,engine", help="comma-separated: verify, decode, engine")
    a = ap.parse_args()
    if a.quick:
        a.new, a.repeats = 12, 1
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    cut = int(a.draft.split(":", 1)[1]) if a.draft and a.draft.startswith("cut:") else None
    if cut is not None and a.folder:
        ap.error("--draft cut:N builds its pair from random weights: not with --folder")
    tmp = Path(tempfile.mkdtemp())
    folder = Path(a.folder) if a.folder else build_random(a.quick, dtype, tmp, cut)
    model = qkv.from_pretrained(folder).eval()
    draft_folder = tmp / "draft" if cut is not None else a.draft
    draft = (None if not a.draft else model if a.draft == "same"
             else qkv.from_pretrained(draft_folder).eval())
    ids = prompts(folder, model.output_vocab_size)
    parts = set(a.parts.split(","))
    verify = verify_costs(model, a.repeats) if "verify" in parts else {}
    rows = decode_rows(model, draft, ids, a.new, a.k, a.repeats) if "decode" in parts else []
    engine = (engine_rows(model, draft, ids["rewrite"], a.new, a.k, a.draft_k, a.repeats) if "engine" in parts
              else [])
    meta = {"torch": torch.__version__, "threads": a.threads, "machine": platform.processor() or
            platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "model": str(a.folder or ("random " + ("quick" if a.quick else "SmolLM-135M shape"))),
            "dtype": a.dtype, "new_tokens": a.new, "k": a.k, "repeats": a.repeats, "draft": a.draft,
            "draft_k": a.draft_k,
            "note": "shared, loaded machine: medians of interleaved repeats; compare ratios within this run"}
    lines = [f"model: {meta['model']} ({a.dtype}), {a.threads} threads, {meta['cpu_capability']}"]
    lines += ["", "| new tokens per forward | ms | x one token |", "|---|---|---|"] if verify else []
    lines += [f"| {n} | {ms:.1f} | {ms / verify[1]:.2f} |" for n, ms in verify.items()]
    lines += ["", "| task | method | tok/s | speed-up | acceptance | tokens / forward | = plain |",
              "|---|---|---|---|---|---|---|"] if rows else []
    for r in rows:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        tpf = "1" if r["tokens_per_forward"] is None else f"{r['tokens_per_forward']:.2f}"
        lines.append(f"| {r['task']} ({r['prompt_tokens']} prompt) | {r['method']} | {r['tok_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {acc} | {tpf} | {r['equal_to_plain']} |")
    if engine:
        lines += ["", "| Engine, rewrite task | speculation | tok/s | on / off | acceptance | = off |",
                  "|---|---|---|---|---|---|"]
    for r in engine:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        lines.append(f"| batch {r['batch']} ({r['prompt_tokens']} prompt) | {r['speculation']} | "
                     f"{r['tok_s']:.1f} | {r['speedup']:.2f}x | {acc} | {r['equal_to_off']} |")
    write_results(a.out, "speculative", {"meta": meta, "verify_ms": verify, "decode": rows, "engine": engine},
                  lines)


if __name__ == "__main__":
    main()
