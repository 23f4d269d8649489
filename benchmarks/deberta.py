"""DeBERTa-v3: qkv's DeBERTa vs Hugging Face DebertaV2ForSequenceClassification, the same weights.

A DeBERTa-v3-small-shaped model (6 layers, hidden 768, 12 heads, FFN 3072, vocab 128100, 256 position
buckets, max_relative_positions 512; --layers changes the depth) with random weights is saved by transformers
and loaded by qkv.from_pretrained. Batch 8 x 128 tokens with a padding mask (row lengths 64..128), fp32,
dropout 0. Timed: the eval forward (no grad), and one training step (forward with the classification loss,
backward, AdamW(lr 2e-5), zero_grad; qkv trains on the unpadded rows as `qkv finetune` does). Both models'
outputs are compared first (max |difference| of the logits, eval; of the first step's losses).

Timing: --warmup calls each, then --repeats rounds, each timing every case once in the same order
(benchmarks/_timing.interleaved); reported: median seconds and tokens/s (padding included), and the median of
the per-round ratios qkv / HF time.

    .venv/bin/python benchmarks/deberta.py [--quick] [--layers 6] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved, write_results  # noqa: E402


def build(layers: int, width: int, heads: int, vocab: int,
          folder: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    import transformers

    import qkv

    cfg = transformers.DebertaV2Config(
        vocab_size=vocab, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * width, max_position_embeddings=512, relative_attention=True,
        position_buckets=256,
        max_relative_positions=512, pos_att_type=["p2c", "c2p"], share_att_key=True,
        norm_rel_ebd="layer_norm",
        position_biased_input=False, type_vocab_size=0, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=2, layer_norm_eps=1e-7)
    torch.manual_seed(0)
    hf = transformers.DebertaV2ForSequenceClassification(cfg)
    hf.save_pretrained(folder)
    return hf, qkv.from_pretrained(folder)


def batch(B: int, T: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    ids = torch.randint(4, vocab, (B, T), generator=g).masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, (B,), generator=g)}


def cases(hf: torch.nn.Module, ours: torch.nn.Module, b: dict[str, torch.Tensor]) -> dict:
    inputs = {k: b[k] for k in ("input_ids", "attention_mask")}
    opt = {"qkv": torch.optim.AdamW(ours.parameters(), lr=2e-5),
           "HF": torch.optim.AdamW(hf.parameters(), lr=2e-5)}

    def forward(model: torch.nn.Module) -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            return model(**inputs).logits

    def step(model: torch.nn.Module, name: str) -> float:
        model.train()
        loss = model(**b).loss
        loss.backward()
        opt[name].step()
        opt[name].zero_grad(set_to_none=True)
        return float(loss.detach())

    return {"forward qkv": lambda: forward(ours), "forward HF": lambda: forward(hf),
            "train step qkv": lambda: step(ours, "qkv"), "train step HF": lambda: step(hf, "HF")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true",
                    help="2 layers, width 128, vocab 1000, batch 2 x 32: a smoke run")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = ap.parse_args()
    width, heads, vocab = (128, 2, 1000) if a.quick else (768, 12, 128100)
    layers, B, T = (2, 2, 32) if a.quick else (a.layers, a.batch, a.seq)
    with tempfile.TemporaryDirectory() as tmp:
        hf, ours = build(layers, width, heads, vocab, Path(tmp))
    b = batch(B, T, vocab)
    fns = cases(hf, ours, b)
    diff = float((fns["forward qkv"]() - fns["forward HF"]()).abs().max())
    loss_q, loss_h = fns["train step qkv"](), fns["train step HF"]()  # the first step: the same weights
    for fn in fns.values():
        for _ in range(a.warmup):
            fn()
    times, _ = interleaved(fns, a.repeats)
    tokens = B * T
    rows = []
    lines = [f"DeBERTa-v3 shape: {layers} layers, width {width}, vocab {vocab}, batch {B} x {T} (padded), "
             f"fp32, {torch.get_num_threads()} threads, torch {torch.__version__}, "
             f"{platform.processor() or platform.machine()}",
             f"max |logit difference| (eval) {diff:.2e}; first-step losses qkv {loss_q:.6f}, HF {loss_h:.6f}",
             "", "| case | qkv s | HF s | qkv tokens/s | HF tokens/s | qkv / HF time (median of rounds) |",
             "|---|---|---|---|---|---|"]
    for case in ("forward", "train step"):
        q, h = times[f"{case} qkv"], times[f"{case} HF"]
        ratio = statistics.median(x / y for x, y in zip(q, h))
        mq, mh = statistics.median(q), statistics.median(h)
        rows.append({"case": case, "qkv_s": mq, "hf_s": mh, "ratio": ratio, "qkv_times": q, "hf_times": h})
        lines.append(f"| {case} | {mq:.3f} | {mh:.3f} | {tokens / mq:,.0f} | {tokens / mh:,.0f} | "
                     f"{ratio:.2f} |")
    result = {"config": {"layers": layers, "width": width, "vocab": vocab, "batch": B, "seq": T,
                         "threads": torch.get_num_threads(), "repeats": a.repeats},
              "logit_max_abs_diff": diff, "first_losses": {"qkv": loss_q, "HF": loss_h}, "rows": rows}
    write_results(a.out, "deberta_quick" if a.quick else "deberta", result, lines)


if __name__ == "__main__":
    main()
