"""A small Mixtral (random weights): qkv vs transformers on the same folder, and qkv's MoE against its dense
twin.

Model: MixtralConfig(4 layers, hidden 256, 8 / 2 query / key-value heads, 8 experts of intermediate 512,
top-2, vocab 4096), built by transformers with random weights, saved to a temporary folder in fp32 and loaded
by both. Measured as CPU time of this process (time.process_time, medians of --repeats), one thread by
default: on a shared machine wall time mostly measures the other processes. Only ratios within one run mean
much.
  decode   greedy, prompt 32, --new tokens, batch 1: tokens per CPU second of qkv.generate (KV cache) and
           transformers' generate
  prefill  one forward over a 512-token prompt
  train    one forward+backward of qkv's GPT over (8, 256) tokens: the MoE model, and the dense model with the
           same active FFN width (d_ff = 2 x 512 = 1024: what each token runs), for the dispatch's overhead

    .venv/bin/python benchmarks/moe.py [--threads 1] [--new 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def timed(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        out.append(time.process_time() - t)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import transformers

    import qkv
    from qkv.generate import generate
    from qkv.models.gpt import GPT
    from qkv.nn.moe import MoEConfig

    cfg = transformers.MixtralConfig(vocab_size=4096, hidden_size=256, intermediate_size=512,
                                     num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
                                     num_experts_per_tok=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = qkv.from_pretrained(d)
    prompt = torch.randint(3, 4096, (1, 32))
    long = torch.randint(3, 4096, (1, 512))
    kw = dict(max_new_tokens=a.new, min_new_tokens=a.new)
    rows = []
    with torch.no_grad():
        hf_gen = timed(lambda: hf.generate(prompt, attention_mask=torch.ones_like(prompt),
                                           do_sample=False, **kw),
                       a.repeats)
        our_gen = timed(lambda: generate(ours, prompt, **kw), a.repeats)
        hf_pre = timed(lambda: hf(long, logits_to_keep=1), a.repeats)
        our_pre = timed(lambda: ours(long, last_only=True), a.repeats)
    rows += [("decode tokens per CPU s, batch 1", a.new / our_gen, a.new / hf_gen),
             ("prefill 512, CPU ms", our_pre * 1e3, hf_pre * 1e3)]
    same = dict(ours.config.__dict__)
    dense_cfg = type(ours.config)(**{**same, "moe": MoEConfig(), "d_ff": 1024})
    moe_train, dense = ours.train(), GPT(dense_cfg).train()
    ids = torch.randint(0, 4096, (8, 256))

    def step(model):
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    t_moe, t_dense = timed(lambda: step(moe_train), a.repeats), timed(lambda: step(dense), a.repeats)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {a.threads} threads")
    print("| measure | qkv | transformers |\n|---|---|---|")
    for name, x, y in rows:
        print(f"| {name} | {x:.1f} | {y:.1f} |")
    print(f"\ntrain step (8 x 256 tokens), CPU ms: MoE {t_moe * 1e3:.0f}, dense (same active width) "
          f"{t_dense * 1e3:.0f} ({ours.num_parameters():,} vs {dense.num_parameters():,} parameters)")


if __name__ == "__main__":
    main()
