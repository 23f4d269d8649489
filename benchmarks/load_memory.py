"""Peak resident memory of qkv.from_pretrained on Hugging Face folders, as a multiple of the weights' bytes.

Folders: random-weight GPT2LMHeadModel (GPT-2 small's shape, 124M) and BertModel (BERT-base's shape, 110M),
and for comparison LlamaForCausalLM (SmolLM-135M's shape: the Llama-family loader, benchmarks/llm.py's model),
built by transformers and saved as model.safetensors in fp32 and in bf16 (a temporary folder); GPT-2's fp32
weights also as a pytorch_model.bin (torch.save of the state dict). Each folder is loaded in a fresh
subprocess per code version, after the imports the load needs (torch, qkv, the family's loader, safetensors):

    ratio = (VmHWM after the load - VmRSS before it) / bytes of the loaded model's parameters

`--before REF` adds rows for the src/ of a git ref (extracted with git archive into the temporary folder), so
one run compares the code before and after a change on the same folders and machine; `--transformers` adds
rows for transformers' from_pretrained(dtype="auto") on the same folders (AutoModelForCausalLM / AutoModel)
(its own model classes).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/load_memory.py [--before main] [--transformers] [--quick]
        [--out benchmarks/results]

--quick: 2-layer, width-64 models (a smoke run). Writes OUT/load_memory.json and OUT/load_memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from _timing import write_results  # noqa: E402

SHAPES = {
    "gpt2-124M": ("GPT2Config", "GPT2LMHeadModel", "gpt2",
                  dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                                                                 n_positions=1024)),
    "bert-base": ("BertConfig", "BertModel", "bert",
                  dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                                                          intermediate_size=3072, vocab_size=30522)),
    # the Llama-family loader's figures (benchmarks/llm.py's SmolLM-135M shape), for comparison
    "llama-135M": ("LlamaConfig", "LlamaForCausalLM", "llama", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True)),
}
QUICK = {
    "gpt2-124M": dict(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=64),
    "bert-base": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
                      vocab_size=500, max_position_embeddings=64),
    "llama-135M": dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True),
}

_PROBE = r"""
import importlib, json, sys
folder, library, src, family = sys.argv[1:5]
sys.path.insert(0, src)
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
import torch, safetensors.torch
if library == "transformers":
    import transformers
    before = rss("VmRSS:")
    auto = transformers.AutoModelForCausalLM if family in ("gpt2", "llama") else transformers.AutoModel
    model = auto.from_pretrained(folder, dtype="auto")
else:
    import qkv
    importlib.import_module("qkv.interop." + family)  # the loader's imports are not the load's memory
    before = rss("VmRSS:")
    model = qkv.from_pretrained(folder)
peak = rss("VmHWM:")
nbytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
dtype = str(next(model.parameters()).dtype)
print(json.dumps({"before": before, "peak": peak, "weights": nbytes, "dtype": dtype}))
"""


def load_peak(folder: Path, library: str, src: Path, family: str) -> dict:
    """Peak RSS growth while `library` (qkv from `src`, or transformers) loads `folder`, in a fresh
    process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _PROBE, str(folder), library, str(src), family],
                       capture_output=True, text=True, env=env, timeout=900)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    d = json.loads(r.stdout.strip().splitlines()[-1])
    d["growth"] = d["peak"] - d["before"]
    d["ratio"] = round(d["growth"] / d["weights"], 3)
    return d


def make_folders(tmp: Path, quick: bool) -> dict[str, tuple[Path, str]]:
    import torch
    import transformers

    folders = {}
    for name, (config_cls, model_cls, family, kw) in SHAPES.items():
        torch.manual_seed(0)
        model = getattr(transformers,
                        model_cls)(getattr(transformers, config_cls)(**(QUICK[name] if quick else kw)))
        for dtype in ("fp32", "bf16"):
            folder = tmp / f"{name}-{dtype}"
            (model if dtype == "fp32" else model.to(torch.bfloat16)).save_pretrained(folder)
            folders[f"{name} {dtype}"] = (folder, family)
        # the same fp32 weights as an older folder's pytorch_model.bin (a pickle, read whole)
        if family == "gpt2":
            from safetensors.torch import load_file

            folder = tmp / f"{name}-bin"
            shutil.copytree(tmp / f"{name}-fp32", folder)
            torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
            (folder / "model.safetensors").unlink()
            folders[f"{name} fp32 .bin"] = (folder, family)
        del model
    return folders


def extract(ref: str, into: Path) -> Path:
    """src/ of git ref `ref`, extracted under `into`."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT.parent), "archive", ref, "src"],
                             capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "src"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="also measure the src/ of this git ref (e.g. main)")
    ap.add_argument("--transformers", action="store_true", help="also measure transformers' from_pretrained")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args()
    head = subprocess.run(["git", "-C", str(ROOT.parent), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    if subprocess.run(["git", "-C", str(ROOT.parent), "diff", "--quiet", "HEAD", "--", "src"]).returncode:
        head += " + uncommitted src"
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        versions = {}
        if a.before:
            versions[f"qkv {a.before}"] = ("qkv", extract(a.before, tmp / "before"))
        versions[f"qkv {head or 'this tree'}"] = ("qkv", ROOT.parent / "src")
        if a.transformers:
            versions["transformers"] = ("transformers", ROOT.parent / "src")
        folders = make_folders(tmp, a.quick)
        rows = {f"{fname} | {vname}": load_peak(folder, lib, src, family)
                for fname, (folder, family) in folders.items() for vname, (lib, src) in versions.items()}
    result = {"machine": platform.platform(), "python": sys.version.split()[0],
              "quick": a.quick, "loads": rows}
    lines = ["| folder | code | weights MB | peak RSS growth MB | x weights |", "|---|---|---|---|---|"]
    lines += [f"| {k} | {d['weights'] / 1e6:.0f} | {d['growth'] / 1e6:.0f} | {d['ratio']} |"
                  for k, d in rows.items()]
    write_results(a.out, "load_memory", result, lines)


if __name__ == "__main__":
    main()
