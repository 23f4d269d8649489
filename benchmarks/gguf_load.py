"""Loading a GGUF file: qkv vs transformers' own GGUF loader, on a 135M-class Llama (SmolLM-135M's shape,
random weights, as benchmarks/llm.py builds it) written as F16, Q8_0 and Q4_0 files the way llama.cpp's
converter writes them (tests/interop/_gguf_files.py: q/k rows permuted, norms F32).

Measured per file and library, each in a fresh subprocess: wall time of the load, and peak resident memory
growth while loading ((VmHWM after - VmRSS before) / bytes of the model's weights as loaded). qkv loads a
quantized file in bfloat16 by default (`dtype=` changes it), transformers in float32 here (its default), so
the table also gives qkv with dtype=float32, and qkv loading the same model from an fp16 Hugging Face folder
for scale (both include building qkv's GPT, several seconds of a first load in a process). Then the largest
logit difference of qkv vs transformers, both float32, on one 64-token batch.

    .venv/bin/python benchmarks/gguf_load.py [--layers 30] [--types F16,Q8_0,Q4_0]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "interop"))


def _child(kind: str, path: str, dtype: str) -> None:
    import torch

    def rss(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        return 0

    before = rss("VmRSS")
    t0 = time.perf_counter()
    if kind == "qkv":
        import qkv

        dtype = "default" if Path(path).is_dir() else dtype
        model = qkv.from_pretrained(path, dtype=None if dtype == "default" else getattr(torch, dtype))
    else:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(str(Path(path).parent),
                                                                  gguf_file=Path(path).name,
                                                                  dtype=getattr(torch, dtype))
    seconds = time.perf_counter() - t0
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"s": seconds, "peak": (rss("VmHWM") - before) / nbytes,
                      "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}))


def _measure(kind: str, path: Path, dtype: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, str(path), dtype], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--types", default="F16,Q8_0,Q4_0")
    ap.add_argument("--child", nargs=3)
    a = ap.parse_args()
    if a.child:
        return _child(*a.child)
    import torch
    import transformers
    from _gguf_files import Q, bpe_vocab, write_gguf

    import qkv

    vocab = bpe_vocab()
    vocab["tokens"] += [f"<filler{i}>" for i in range(49152 - len(vocab["tokens"]))]
    vocab["types"] += [1] * (49152 - len(vocab["types"]))
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                      num_hidden_layers=a.layers, num_attention_heads=9,
                                      num_key_value_heads=3,
                                      max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    print(f"Llama {a.layers} layers, {sum(p.numel() for p in hf.parameters()) / 1e6:.1f}M parameters, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    print("| file | size MB | library | dtype | load s | peak / weights | max abs logit diff (fp32) |")
    print("|---|---|---|---|---|---|---|")
    ids = torch.randint(0, 49152, (1, 64), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.types.split(","):
            path = Path(tmp) / f"smol-{name}.gguf"
            write_gguf(path, hf, "llama", vocab, Q[name])
            size = path.stat().st_size / 1e6
            with torch.no_grad():
                diff = (qkv.from_pretrained(path, dtype=torch.float32)(ids).logits
                        - transformers.AutoModelForCausalLM
                        .from_pretrained(tmp, gguf_file=path.name,
                                         dtype=torch.float32)(ids).logits).abs().max()
            for kind, dtype in (("qkv", "default"), ("qkv", "float32"), ("transformers", "float32")):
                r = _measure(kind, path, dtype)
                print(f"| {name} | {size:.0f} | {kind} | {r['dtype']} | {r['s']:.2f} | {r['peak']:.2f} | "
                      f"{diff.item():.2e} |")
            path.unlink()
        folder = Path(tmp) / "folder-fp16"  # the same model as a Hugging Face folder, for scale
        hf.half().save_pretrained(folder)
        r = _measure("qkv", folder, "default")
        print(f"| HF folder (fp16 safetensors) | {sum(f.stat().st_size for f in folder.iterdir()) / 1e6:.0f} "
              f"| qkv | {r['dtype']} | {r['s']:.2f} | {r['peak']:.2f} | |")


if __name__ == "__main__":
    main()
