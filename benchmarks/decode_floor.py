"""Batch-1 decoding of every decoder family against its own weight-streaming floor (issue 15), and the
same step in `transformers` on the same weights.

A decoding step at batch 1 reads every weight it uses once (a matrix-vector product per linear layer), so
its time cannot be below  floor = bytes of the weights a step reads / memory read bandwidth.
The bandwidth is measured in the same run, interleaved with the decoding rounds (a sum over a 256 MiB fp32
tensor, far larger than the caches; the best sample, so that the floor stays a lower bound on a loaded machine). Bytes a step reads: the decoder blocks (without the cross-attention
key/value projections, which run once per source at prefill), the final norm and the output projection (the
whole vocabulary matrix, tied or not); the token/position embedding lookups read one row and are not counted.

Families, each a Hugging Face model built from a config with random weights, saved to a temporary folder
and loaded by qkv.from_pretrained, so both libraries decode the same weights:
  gpt2    GPT-2 124M (12 x 768, learned positions, LayerNorm, GELU)
  llama   a 135M-class Llama (30 x 576, 9/3 GQA heads, RoPE, RMSNorm, SwiGLU, tied; SmolLM-135M's shape)
  t5      the decoder of t5-small (6 x 512, relative position bias, cross-attention, untied head)
  bart    the decoder of bart-base (6 x 768, learned positions, cross-attention, tied head)
Timed: `model.step` (qkv) and a `transformers` forward with its cache (use_cache, one new token), each after
a 32-token prompt (a 32-token source for the encoder-decoders), greedy, `--steps` steps per repeat; fp32,
`--threads` threads; `--repeats` interleaved rounds (bandwidth, then each family and library in turn), medians.
The greedy tokens of the two libraries are compared step for step (share equal).

    .venv/bin/python benchmarks/decode_floor.py [--quick] [--threads 2] [--steps 64] [--repeats 5] [--ab]

--ab: a third column, qkv with every linear of the step through its pre-transposed copy (the layout choice of
Linear.step, qkv.nn.linear.STEP_NARROW_DIRECT, measured side by side).
--ab-step: a column "qkv previous step": qkv with the batch-1 step's fast paths of step12c switched off
(benchmarks/_step_switches.py: one-thread attention products, joint gate/up product, one-pass RoPE, dot-product
RMSNorm), timed in the same interleaved rounds.

--quick: tiny configs, a few steps, one round (the smoke test, tests/test_benchmark_decode_floor.py).
Writes OUT/decode_floor.json and decode_floor.md (OUT = benchmarks/results; --md also copies the table).
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
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/generate.py

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

import qkv  # noqa: E402
import qkv.nn.linear  # noqa: E402
from _step_switches import previous_step  # noqa: E402

FULL = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12,
                                                   n_head=12)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                                      num_hidden_layers=30, num_attention_heads=9,
                                                      num_key_value_heads=3, max_position_embeddings=2048,
                                                      tie_word_embeddings=True)),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048,
                                                          num_layers=6, num_heads=8, tie_word_embeddings=False)),
    "bart": ("BartConfig", "BartForConditionalGeneration", dict(vocab_size=50265, d_model=768, encoder_layers=6,
                                                                decoder_layers=6, encoder_attention_heads=12,
                                                                decoder_attention_heads=12, encoder_ffn_dim=3072,
                                                                decoder_ffn_dim=3072, max_position_embeddings=1024)),
}
QUICK = {
    "gpt2": dict(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4),
    "llama": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True),
    "t5": dict(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, tie_word_embeddings=False),
    "bart": dict(vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128),
}
LIBS = ("qkv", "transformers", "qkv-transposed", "qkv-previous-step")
NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "llama": {},
              "t5": dict(dropout_rate=0.0), "bart": dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)}


def read_bandwidth(x: torch.Tensor, n: int = 3) -> float:
    """GB/s of a plain read of `x` (the minimum time of n sums: the least-disturbed sample)."""
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * x.element_size() / best / 1e9


def step_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one decoding step reads: decoder blocks (minus cross-attention K/V projections),
    final norm, output projection."""
    skip = {id(p) for blk in model.decoder.blocks if blk.cross is not None for p in blk.cross.kv_proj.parameters()}
    params = {id(p): p for p in model.decoder.blocks.parameters() if id(p) not in skip}
    if model.decoder.final_norm is not None:
        params.update({id(p): p for p in model.decoder.final_norm.parameters()})
    params.update({id(p): p for p in model.lm_head.parameters()})
    return sum(p.numel() * p.element_size() for p in params.values())


def build(name: str, quick: bool, tmp: Path):
    import transformers

    cfg_cls, model_cls, spec = FULL[name]
    spec = {**(QUICK[name] if quick else spec), **NO_DROPOUT[name]}
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**spec)).eval()
    hf.save_pretrained(tmp / name)
    return hf, qkv.from_pretrained(tmp / name).eval()


def decoders(name: str, hf, ours, prompt: torch.Tensor, steps: int):
    """Two callables running `steps` greedy steps after the prompt (qkv, transformers); each returns the tokens
    and the seconds the steps took (the prefill is not timed)."""
    seq2seq = ours.is_seq2seq
    start = torch.zeros(1, 1, dtype=torch.long) + (getattr(hf.config, "decoder_start_token_id", None) or 0)

    def run_qkv() -> tuple[list[int], float]:
        cache = ours.make_cache(1, (1 if seq2seq else prompt.shape[1]) + steps + 1)
        if seq2seq:
            logits, _ = ours.prefill(start, cache, source=ours.encode_source(prompt))
        else:
            logits, _ = ours.prefill(prompt, cache)
        out = []
        t0 = time.perf_counter()
        for _ in range(steps):
            nxt = logits.argmax(-1, keepdim=True)
            out.append(int(nxt))
            logits = ours.step(nxt, cache)
        return out, time.perf_counter() - t0

    def run_hf() -> tuple[list[int], float]:
        if seq2seq:
            enc = hf.get_encoder()(prompt)
            o = hf(encoder_outputs=enc, decoder_input_ids=start, use_cache=True)
        else:
            o = hf(prompt, use_cache=True)
        out = []
        t0 = time.perf_counter()
        for _ in range(steps):
            nxt = o.logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(nxt))
            if seq2seq:
                o = hf(encoder_outputs=enc, decoder_input_ids=nxt, past_key_values=o.past_key_values, use_cache=True)
            else:
                o = hf(nxt, past_key_values=o.past_key_values, use_cache=True)
        return out, time.perf_counter() - t0

    def run_qkv_transposed() -> tuple[list[int], float]:
        """The A/B control of Linear.step's layout choice: every linear through its transposed copy."""
        qkv.nn.linear.STEP_NARROW_DIRECT = False
        try:
            return run_qkv()
        finally:
            qkv.nn.linear.STEP_NARROW_DIRECT = True

    def run_qkv_previous() -> tuple[list[int], float]:
        """The A/B control of step12c's fast paths: the step as before them."""
        with previous_step():
            return run_qkv()

    return run_qkv, run_hf, run_qkv_transposed, run_qkv_previous


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny configs, a few steps, one round (smoke test)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64, help="decoding steps per timed run")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ab", action="store_true", help="also time qkv with every linear through its transposed copy")
    ap.add_argument("--ab-step", action="store_true", help="also time qkv with step12c's fast paths off")
    ap.add_argument("--families", nargs="+", default=list(FULL), choices=list(FULL))
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--md", default=None, help="also write the markdown table here (e.g. docs/perf/decode_floor.md)")
    a = ap.parse_args(argv)
    if a.quick:
        a.steps, a.repeats, a.prompt = 4, 1, 8
    torch.set_num_threads(a.threads)
    import transformers

    tmp = Path(tempfile.mkdtemp(prefix="qkv-decode-floor-"))
    models = {name: build(name, a.quick, tmp) for name in a.families}
    big = torch.ones((16 if a.quick else 256) * 1024 * 1024 // 4)  # 16 MiB / 256 MiB of fp32, read by sum()
    runs, agree, nbytes = {}, {}, {}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, (hf, ours) in models.items():
            prompt = torch.randint(4, ours.output_vocab_size, (1, a.prompt), generator=gen)
            runs[name] = dict(zip(LIBS, decoders(name, hf, ours, prompt, a.steps)))
            if not a.ab:
                del runs[name]["qkv-transposed"]
            if not a.ab_step:
                del runs[name]["qkv-previous-step"]
            toks = {lib: fn()[0] for lib, fn in runs[name].items()}  # warm-up, and the tokens compared
            agree[name] = sum(x == y for x, y in zip(toks["qkv"], toks["transformers"])) / a.steps
            for other in ("qkv-transposed", "qkv-previous-step"):
                if other in toks:
                    agree[name] = min(agree[name], sum(x == y for x, y in zip(toks["qkv"], toks[other])) / a.steps)
            nbytes[name] = step_bytes(ours)
        read_bandwidth(big, 1)
        gbps: list[float] = []
        times: dict[tuple[str, str], list[float]] = {(n, lib): [] for n in models for lib in runs[n]}
        for _ in range(a.repeats):
            for name in models:
                gbps.append(read_bandwidth(big))
                for lib, fn in runs[name].items():
                    times[(name, lib)].append(fn()[1])
    # the floor is a lower bound on a step's time: use the best bandwidth seen (on a loaded machine the median
    # of a 2-thread sum is itself slowed by the load, and a floor from it can sit above a step's real time)
    bw = max(gbps)
    rows = []
    for name in models:
        floor_ms = nbytes[name] / (bw * 1e9) * 1e3
        ms = {lib: 1e3 * statistics.median(times[(name, lib)]) / a.steps for lib in runs[name]}
        rows.append({"family": name, "weights_mb_per_step": round(nbytes[name] / 1e6, 1), "floor_ms": round(floor_ms, 4),
                     "qkv_ms": round(ms["qkv"], 3), "qkv_x_floor": round(ms["qkv"] / floor_ms, 2),
                     "hf_ms": round(ms["transformers"], 3), "hf_x_floor": round(ms["transformers"] / floor_ms, 2),
                     "qkv_speedup_vs_hf": round(ms["transformers"] / ms["qkv"], 3), "tokens_equal": round(agree[name], 3)})
        if a.ab:
            rows[-1]["qkv_transposed_ms"] = round(ms["qkv-transposed"], 3)
            rows[-1]["narrow_direct_speedup"] = round(ms["qkv-transposed"] / ms["qkv"], 3)
        if a.ab_step:
            rows[-1]["qkv_previous_step_ms"] = round(ms["qkv-previous-step"], 3)
            rows[-1]["previous_step_x_floor"] = round(ms["qkv-previous-step"] / floor_ms, 2)
            rows[-1]["step12c_speedup"] = round(ms["qkv-previous-step"] / ms["qkv"], 3)
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "threads": a.threads,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "machine": platform.processor() or platform.machine(),
            "steps": a.steps, "prompt": a.prompt, "repeats": a.repeats, "quick": a.quick, "bandwidth_gbps": round(bw, 2), "bandwidth_median_gbps": round(statistics.median(gbps), 2),
            "bandwidth_samples": [round(g, 2) for g in gbps]}
    lines = [f"fp32, batch 1, {a.threads} threads, CPU {meta['cpu_capability']}; read bandwidth {bw:.1f} GB/s (best of "
             f"{len(gbps)} samples interleaved with the runs, median {statistics.median(gbps):.1f}); prompt {a.prompt}, {a.steps} greedy steps timed after the prefill "
             f"(argmax included), median of {a.repeats} interleaved rounds", "",
             "| family | weights read per step MB | floor ms | qkv ms/step | qkv x floor | transformers ms/step | "
             "transformers x floor | qkv speed-up | tokens equal |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['family']} | {r['weights_mb_per_step']} | {r['floor_ms']} | {r['qkv_ms']} | {r['qkv_x_floor']} | "
              f"{r['hf_ms']} | {r['hf_x_floor']} | {r['qkv_speedup_vs_hf']}x | {r['tokens_equal']} |" for r in rows]
    if a.ab:
        lines += ["", "A/B of Linear.step's layout (qkv.nn.linear.STEP_NARROW_DIRECT): down projections through the (out, in) "
                  "weight (default) vs every linear through its transposed copy", "",
                  "| family | qkv ms/step | all transposed ms/step | speed-up of the default |", "|---|---|---|---|"]
        lines += [f"| {r['family']} | {r['qkv_ms']} | {r['qkv_transposed_ms']} | {r['narrow_direct_speedup']}x |"
                  for r in rows]
    if a.ab_step:
        lines += ["", "A/B of step12c's batch-1 step fast paths (benchmarks/_step_switches.py): qkv as shipped vs the same "
                  "step with them off, in the same interleaved rounds", "",
                  "| family | qkv ms/step | x floor | previous step ms/step | x floor | speed-up |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['family']} | {r['qkv_ms']} | {r['qkv_x_floor']} | {r['qkv_previous_step_ms']} | "
                  f"{r['previous_step_x_floor']} | {r['step12c_speedup']}x |" for r in rows]
    table = "\n".join(lines) + "\n"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "decode_floor_quick" if a.quick else "decode_floor"
    result = {"meta": meta, "rows": rows}
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (out / f"{stem}.md").write_text(table)
    if a.md:
        Path(a.md).write_text(table)
    print(table)
    return result


if __name__ == "__main__":
    main()
