"""Beam-search translation speed: qkv vs Hugging Face `MarianMTModel.generate`, the same weights.

Model: Marian-shaped (OPUS-MT en-de's shape: 6+6 layers, 512 wide, 8 heads, FFN 2048, SiLU, vocabulary 58101,
sinusoidal positions, scaled embeddings), random weights built by transformers from a MarianConfig, saved to a
temporary folder and loaded into qkv through `qkv.from_pretrained`. Input: `--sentences` random source
sentences of 12-24 tokens (right-padded batches of `--batch-size`), beam search with num_beams 4,
length_penalty 0.6, no_repeat_ngram_size 3, early_stopping, `--max-new-tokens` (random weights rarely say
eos, so most beams run to the limit: the same work in both libraries). Every configuration runs `--repeats`
times, interleaved, the order reversed every other round (ABBA) so drift of a shared machine hits both alike;
the table reports medians of sentences/s, the median of the per-round ratios to HF with their range, the same
ratio measured in process CPU time (less sensitive to other jobs on a shared machine), and whether the two
libraries produced the same tokens. Only ratios within one run count.

    .venv/bin/python benchmarks/seq2seq_beam.py [--quick] [--out DIR]
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

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

import qkv  # noqa: E402
from qkv.generate import generate  # noqa: E402

FULL = dict(vocab_size=58101, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
            decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
            max_position_embeddings=512)
QUICK = dict(vocab_size=500, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128)
BEAM = dict(num_beams=4, length_penalty=0.6, no_repeat_ngram_size=3, early_stopping=True)


def build_models(shape: dict, seed: int = 0):
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(seed)
    V = shape["vocab_size"]
    cfg = MarianConfig(**shape, pad_token_id=V - 1, decoder_start_token_id=V - 1, eos_token_id=0,
                       forced_eos_token_id=0, activation_function="swish", scale_embedding=True,
                       dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    hf = MarianMTModel(cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        hf = MarianMTModel.from_pretrained(d).eval()  # the folder's generation_config.json, as ours reads it
        ours = qkv.from_pretrained(d).eval()
    return hf, ours


def sources(n: int, vocab: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(12, 25, (n,), generator=g).tolist()
    out = []
    for i in range(0, n, batch):
        ls = lengths[i:i + batch]
        ids = torch.full((len(ls), max(ls)), vocab - 1)
        mask = torch.zeros_like(ids)
        for r, L in enumerate(ls):
            ids[r, :L - 1] = torch.randint(1, vocab - 1, (L - 1,), generator=g)
            ids[r, L - 1] = 0  # eos ends every source, as the tokenizer writes it
            mask[r, :L] = 1
        out.append((ids, mask))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a tiny model, 8 sentences, 1 repeat (smoke test)")
    ap.add_argument("--sentences", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args()
    if a.quick:
        a.sentences, a.batch_size, a.max_new_tokens, a.repeats = 8, 4, 8, 1
    if a.threads:
        torch.set_num_threads(a.threads)
    shape = QUICK if a.quick else FULL
    hf, ours = build_models(shape)
    batches = sources(a.sentences, shape["vocab_size"], a.batch_size)
    opts = dict(BEAM, max_new_tokens=a.max_new_tokens)

    def run_qkv(bs=batches) -> list[torch.Tensor]:
        return [generate(ours, x, attention_mask=m, **opts) for x, m in bs]

    def run_hf(bs=batches) -> list[torch.Tensor]:
        with torch.no_grad():
            return [hf.generate(input_ids=x, attention_mask=m, do_sample=False, **opts)[:, 1:] for x, m in bs]

    configs = {"qkv beam search": run_qkv, "HF MarianMTModel.generate": run_hf}
    for fn in configs.values():  # warm-up: the first batch
        fn(batches[:1])
    times: dict[str, list[float]] = {k: [] for k in configs}
    cpu: dict[str, list[float]] = {k: [] for k in configs}
    outs: dict[str, list[torch.Tensor]] = {}
    order = list(configs)
    for r in range(a.repeats):
        for k in (order if r % 2 == 0 else order[::-1]):
            t0, c0 = time.perf_counter(), time.process_time()
            outs[k] = configs[k]()
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
        print(f"round {r + 1}/{a.repeats}: " + ", ".join(f"{k} {times[k][-1]:.2f} s" for k in order),
              flush=True)

    def same(x: torch.Tensor, y: torch.Tensor) -> bool:
        w = max(x.shape[1], y.shape[1])
        pad = shape["vocab_size"] - 1
        return torch.equal(torch.nn.functional.pad(x, (0, w - x.shape[1]), value=pad),
                           torch.nn.functional.pad(y, (0, w - y.shape[1]), value=pad))

    hf_key = "HF MarianMTModel.generate"
    equal = all(same(x, y) for k in configs if k != hf_key for x, y in zip(outs[k], outs[hf_key]))
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for k, v in med.items():
        per_round = [h / t for t, h in zip(times[k], times[hf_key])]
        per_round_cpu = [h / t for t, h in zip(cpu[k], cpu[hf_key])]
        rows.append({"config": k, "median_s": round(v, 3), "sentences_per_s": round(a.sentences / v, 2),
                     "vs_hf": round(statistics.median(per_round), 3),
                     "vs_hf_range": [round(min(per_round), 3), round(max(per_round), 3)],
                     "vs_hf_cpu_time": round(statistics.median(per_round_cpu), 3),
                     "times_s": [round(t, 3) for t in times[k]], "cpu_s": [round(t, 3) for t in cpu[k]]})
    lines = ["| config | median s | sentences/s | x HF (median of rounds) | range | x HF in CPU time |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['median_s']} | {r['sentences_per_s']} | {r['vs_hf']} | "
              f"{r['vs_hf_range'][0]}..{r['vs_hf_range'][1]} | {r['vs_hf_cpu_time']} |" for r in rows]
    lines += ["", f"{a.sentences} sentences, batches of {a.batch_size}, num_beams 4, length_penalty 0.6, "
              f"no_repeat_ngram_size 3, early_stopping, max_new_tokens {a.max_new_tokens}; {a.repeats} "
              f"interleaved ABBA rounds; {torch.get_num_threads()} threads, CPU capability "
              f"{torch.backends.cpu.get_cpu_capability()}; tokens identical to HF: {equal}"]
    table = "\n".join(lines)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.processor(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "shape": shape, "sentences": a.sentences, "batch_size": a.batch_size,
            "max_new_tokens": a.max_new_tokens,
            "repeats": a.repeats, "quick": a.quick, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "seq2seq_beam.json").write_text(json.dumps({"meta": meta, "rows": rows, "tokens_equal": equal},
                                                      indent=2))
    (out / "seq2seq_beam.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
