"""qkv's CPU decoding against llama.cpp (an optional peer) on the same weights and the same number of threads.

Model: a Hugging Face Llama folder of SmolLM-135M's shape with random weights (benchmarks/llm.py's FULL:
30 x 576, 9/3 GQA heads, SwiGLU 1536, vocab 49152, tied), or --folder (any plain Llama folder; its weights are
read in fp32). It is saved in fp32 and bf16; GGUF files F32, BF16 and Q8_0 of the same weights are written by
benchmarks/_llamacpp_peer.py (gguf's GGUFWriter). Timed, batch 1, greedy, the same prompt ids in both:
--new decoding steps after a --prompt-token prefill (the prefill is not timed; each step is the argmax of the
last logits and a one-token forward), as pairs of the same precision:
  qkv fp32 (eager: model.prefill, then model.step per token)          vs  llama.cpp F32
  qkv fp32 compiled (generate(..., compile=True))                     vs  llama.cpp F32
  qkv bf16, qkv bf16 compiled                                         vs  llama.cpp BF16
  qkv int8 (qkv.from_pretrained(bf16 folder, quantize="int8"))        vs  llama.cpp Q8_0
  qkv int8 from an fp32 folder (quantize="int8")                      vs  llama.cpp Q8_0
  each int8 compiled                                                  vs  llama.cpp Q8_0
A compiled run is timed through generate(), whose prefill is not separable: its steps' time is that of a run
of --new tokens minus that of a run of one token (the prefill alone), scaled from --new - 1 steps to --new.
The compile itself happens in the warm-up and is not timed (benchmarks/compile_start.py measures it). Every
run of a round is timed in turn (qkv fp32, llama.cpp F32, qkv bf16, ...), --repeats rounds; the table gives
medians, the ratio qkv tok/s / llama.cpp tok/s, and the weight-streaming floor of a step (bytes of the weights
a step reads / the best read bandwidth sampled once per round; Q8_0's bytes are 34 per 32 weights, qkv int8's
are its int8 weights, scales and unquantised tensors). Checks in the same run: the last prompt position's
logits of each llama.cpp file against qkv's at the same precision (max abs difference), and the share of
greedy tokens equal.

llama.cpp runs in a subprocess under the Python of a SEPARATE virtual environment, so qkv's stays clean. Build
it once (it compiles llama.cpp with cmake: tens of minutes on 2 cores):
    python3 -m venv /path/venv-llamacpp
    CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="-DLLAVA_BUILD=OFF" /path/venv-llamacpp/bin/pip install \
        llama-cpp-python gguf safetensors numpy
Then:
    .venv/bin/python benchmarks/llamacpp.py --llamacpp-python /path/venv-llamacpp/bin/python \
        [--threads 2] [--new 128] [--prompt 32] [--repeats 5] [--folder HF_LLAMA_FOLDER] [--quick]
--llamacpp-python defaults to $QKV_LLAMACPP_PYTHON; without it (or with "") the llama.cpp rows read "n/a".
--quick: llm.py's tiny Llama, a few steps, one round (the smoke test,
tests/benchmarks/test_benchmark_llamacpp.py).
Writes OUT/llamacpp.json and llamacpp.md (OUT = benchmarks/results; llamacpp_quick.* with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

import qkv  # noqa: E402
from _timing import write_results  # noqa: E402
from llm import FULL, QUICK, model_bytes  # noqa: E402
from qkv.generate import generate  # noqa: E402

PEER = ROOT / "_llamacpp_peer.py"
# qkv's run, the llama.cpp file of its precision
PAIRS = (("fp32", "F32"), ("fp32 compiled", "F32"), ("bf16", "BF16"), ("bf16 compiled", "BF16"),
         ("int8", "Q8_0"), ("int8 compiled", "Q8_0"), ("int8 from fp32", "Q8_0"),
         ("int8 from fp32 compiled", "Q8_0"))
FILES = ("F32", "BF16", "Q8_0")
COMPILED = ("fp32", "bf16", "int8", "int8 from fp32")  # the runs also timed through generate(compile=True)


def read_bandwidth(x: torch.Tensor, n: int = 3) -> float:
    """GB/s of a plain read of `x` (the minimum time of n sums: the least-disturbed sample)."""
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * x.element_size() / best / 1e9


def eager_decoder(model: torch.nn.Module, prompt: torch.Tensor, steps: int):
    """`steps` greedy steps after the prompt through model.step; returns (tokens, seconds of the steps)."""
    def run() -> tuple[list[int], float]:
        cache = model.make_cache(1, prompt.shape[1] + steps + 1)
        logits, _ = model.prefill(prompt, cache)
        out = []
        t0 = time.perf_counter()
        for _ in range(steps):
            nxt = logits.argmax(-1, keepdim=True)
            out.append(int(nxt))
            logits = model.step(nxt, cache)
        return out, time.perf_counter() - t0
    return run


def compiled_decoder(model: torch.nn.Module, prompt: torch.Tensor, steps: int):
    """The same greedy tokens through generate(..., compile=True); the steps' seconds are a run of `steps`
    tokens minus a run of one (the prefill and the first token), scaled to `steps` steps."""
    def gen(n: int) -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        out = generate(model, prompt, max_new_tokens=n, min_new_tokens=n, compile=True)
        return out, time.perf_counter() - t0

    def run() -> tuple[list[int], float]:
        out, full = gen(steps)
        _, first = gen(1)
        return out[0, prompt.shape[1]:].tolist(), max(full - first, 0.0) * steps / max(steps - 1, 1)
    return run


def hf_folders(spec: dict, folder: str | None, tmp: Path) -> dict[str, Path]:
    """The fp32 and bf16 Hugging Face folders both libraries read: `folder`'s weights, or random ones of
    `spec`."""
    import transformers

    torch.manual_seed(0)
    if folder:
        hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec, bos_token_id=1, eos_token_id=2))
    out = {"fp32": tmp / "fp32", "bf16": tmp / "bf16"}
    hf.save_pretrained(out["fp32"])
    hf.to(torch.bfloat16).save_pretrained(out["bf16"])
    return out


def load_qkv(folders: dict[str, Path]) -> dict[str, torch.nn.Module]:
    """qkv's fp32, bf16 and int8 models; int8 from the bf16 folder and from the fp32 one (most exported
    folders are fp32: its activations are rounded to bf16 for torch's int8 product all the same)."""
    return {"fp32": qkv.from_pretrained(folders["fp32"]).eval(),
            "bf16": qkv.from_pretrained(folders["bf16"]).eval(),
            "int8": qkv.from_pretrained(folders["bf16"], quantize="int8").eval(),
            "int8 from fp32": qkv.from_pretrained(folders["fp32"], quantize="int8").eval()}


def qkv_runs(models: dict[str, torch.nn.Module], prompt: torch.Tensor, new: int, compiled: bool) -> dict:
    runs = {k: eager_decoder(m, prompt, new) for k, m in models.items()}
    if compiled:
        runs.update({f"{k} compiled": compiled_decoder(models[k], prompt, new) for k in COMPILED})
    return runs


class Peer:
    """llama.cpp in a subprocess (benchmarks/_llamacpp_peer.py serve) holding every GGUF file loaded."""

    def __init__(self, python: str, threads: int, n_ctx: int, files: dict[str, Path]) -> None:
        args = [python, str(PEER), "serve", str(threads), str(n_ctx)] + [f"{k}={v}" for k, v in files.items()]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp peer stopped (exit {self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def decode(self, model: str, prompt: list[int], new: int) -> tuple[list[int], float]:
        """`new` greedy steps after `prompt` in llama.cpp: (the tokens, the seconds the steps took)."""
        r = self.ask(op="decode", model=model, prompt=prompt, new=new)
        return r["tokens"], r["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def peer_python(arg: str | None) -> tuple[str | None, str]:
    """The separate environment's Python when it imports llama_cpp, gguf and safetensors; else (None, why
    not)."""
    python = os.environ.get("QKV_LLAMACPP_PYTHON", "") if arg is None else arg
    if not python:
        return None, "no --llamacpp-python (nor $QKV_LLAMACPP_PYTHON)"
    try:
        r = subprocess.run([python, "-c", "import llama_cpp, gguf, safetensors"], capture_output=True,
                           text=True, timeout=120)
    except OSError as e:
        return None, f"{python}: {e}"
    return (python, "") if r.returncode == 0 else (None, f"{python} lacks llama_cpp/gguf/safetensors: "
                                                         f"{r.stderr.strip().splitlines()[-1:]}")


def write_gguf(python: str, folder: Path, out: Path) -> dict[str, Path]:
    r = subprocess.run([python, str(PEER), "write", str(folder), str(out)], capture_output=True, text=True,
                       timeout=1800)
    if r.returncode:
        raise RuntimeError(f"writing the GGUF files failed: {r.stderr[-3000:]}")
    return {fmt: out / f"{fmt}.gguf" for fmt in FILES}


def qkv_logits(model: torch.nn.Module, prompt: torch.Tensor) -> torch.Tensor:
    """The last prompt position's logits, through the same prefill the timed loop starts from."""
    return model.prefill(prompt, model.make_cache(1, prompt.shape[1] + 1))[0].reshape(-1).float()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llamacpp-python", default=None,
                    help="Python of the venv with llama-cpp-python ('' = none)")
    ap.add_argument("--folder", default=None,
                    help="a Hugging Face Llama folder (default: random SmolLM-135M shape)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=128, help="timed decoding steps per run")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true", help="skip the 'compiled' rows")
    ap.add_argument("--quick", action="store_true", help="a tiny Llama, a few steps, one round (smoke test)")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args(argv)
    if a.quick:
        a.new, a.repeats, a.prompt = 8, 1, 8
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    python, absent = peer_python(a.llamacpp_python)
    tmp = Path(tempfile.mkdtemp(prefix="qkv-llamacpp-bench-"))
    folders = hf_folders(QUICK if a.quick else FULL, a.folder, tmp)
    models = load_qkv(folders)
    vocab = models["fp32"].output_vocab_size
    prompt = torch.randint(4, vocab, (1, a.prompt), generator=torch.Generator().manual_seed(0))
    runs = qkv_runs(models, prompt, a.new, not a.no_compile)
    peer = None
    if python:
        peer = Peer(python, a.threads, a.prompt + a.new + 1, write_gguf(python, folders["fp32"], tmp))
        runs.update({fmt: lambda fmt=fmt: peer.decode(fmt, prompt[0].tolist(), a.new) for fmt in FILES})
    big = torch.ones((16 if a.quick else 256) * 1024 * 1024 // 4)  # 16 / 256 MiB of fp32, read by sum()
    with torch.no_grad():
        tokens = {k: fn()[0] for k, fn in runs.items()}  # warm-up, and the tokens compared
        logits = {k: qkv_logits(m, prompt) for k, m in models.items()}
        logits.update({f"{k} compiled": logits[k] for k in COMPILED})  # the same prefill
        if peer:
            for fmt in FILES:
                path = str(tmp / f"{fmt}.npy")
                peer.ask(op="logits", model=fmt, prompt=prompt[0].tolist(), path=path)
                logits[fmt] = torch.from_numpy(np.load(path))
        read_bandwidth(big, 1)
        gbps, times = [], {k: [] for k in runs}
        for _ in range(a.repeats):
            gbps.append(read_bandwidth(big))
            for k, fn in runs.items():
                times[k].append(fn()[1])
    if peer:
        peer.close()
    bw = max(gbps)
    floor_bytes = {k: model_bytes(m) for k, m in models.items()}
    floor_bytes.update({f"{k} compiled": floor_bytes[k] for k in COMPILED})
    floor_bytes.update({"F32": floor_bytes["fp32"], "BF16": floor_bytes["bf16"],
                        "Q8_0": floor_bytes["fp32"] / 4 * 34 / 32})
    rows = [row(ours, fmt, times, tokens, logits,
                {k: floor_bytes[k] / (bw * 1e9) * 1e3 for k in (ours, fmt)}, a.new)
            for ours, fmt in PAIRS if ours in runs]
    meta = {"torch": torch.__version__, "threads": a.threads,
            "machine": platform.processor() or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "quick": a.quick, "folder": a.folder,
            "prompt": a.prompt, "new_tokens": a.new, "repeats": a.repeats, "bandwidth_gbps": round(bw, 2),
            "bandwidth_samples": [round(g, 2) for g in gbps],
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "llamacpp": peer.info if peer else None, "llamacpp_absent": absent,
            "note": "shared, loaded machine: medians of interleaved rounds; compare ratios within this run"}
    result = {"meta": meta, "rows": rows}
    write_results(a.out, "llamacpp_quick" if a.quick else "llamacpp", result, table(meta, rows))
    return result


def row(ours: str, fmt: str, times: dict, tokens: dict, logits: dict, floor_ms: dict, new: int) -> dict:
    """One precision: qkv's `ours` model against llama.cpp's `fmt` file (None where either did not run)."""
    ms = {k: 1e3 * statistics.median(times[k]) / new if k in times else None for k in (ours, fmt)}
    both = ms[ours] is not None and ms[fmt] is not None
    r = {"qkv": ours, "llamacpp": fmt, "qkv_ms": ms[ours], "llamacpp_ms": ms[fmt],
         "qkv_floor_ms": floor_ms[ours], "llamacpp_floor_ms": floor_ms[fmt],
         "qkv_tok_s": 1e3 / ms[ours] if ms[ours] else None,
         "llamacpp_tok_s": 1e3 / ms[fmt] if ms[fmt] else None,
         "ratio": ms[fmt] / ms[ours] if both else None,  # qkv tok/s / llama.cpp tok/s
         "qkv_x_floor": ms[ours] / floor_ms[ours] if ms[ours] else None,
         "llamacpp_x_floor": ms[fmt] / floor_ms[fmt] if ms[fmt] else None,
         "tokens_equal": sum(x == y for x, y in zip(tokens[ours], tokens[fmt])) / new if both else None,
         "logits_max_diff": (logits[ours] - logits[fmt]).abs().max().item() if both else None,
         "logits_scale": logits[ours].abs().max().item() if ours in logits else None}
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}


def table(meta: dict, rows: list[dict]) -> list[str]:
    def f(v, nd=2):
        return "n/a" if v is None else f"{v:.{nd}f}"

    peer = meta["llamacpp"]
    head = (f"batch 1, {meta['threads']} threads, CPU {meta['cpu_capability']}; llama-cpp-python "
            f"{peer['llama_cpp_python'] if peer else 'n/a (' + meta['llamacpp_absent'] + ')'}; "
            f"read bandwidth {meta['bandwidth_gbps']:.1f} GB/s (best of {meta['repeats']}); prompt "
            f"{meta['prompt']}, {meta['new_tokens']} greedy steps timed after the prefill, median of "
            f"{meta['repeats']} interleaved rounds")
    lines = [head, "", "| qkv | llama.cpp | qkv ms/tok | llama.cpp ms/tok | qkv tok/s | llama.cpp tok/s | "
             "qkv / llama.cpp tok/s | qkv floor ms | qkv x floor | llama.cpp x floor | tokens equal | "
             "max logit diff (scale) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['qkv']} | {r['llamacpp']} | {f(r['qkv_ms'])} | {f(r['llamacpp_ms'])} | "
                     f"{f(r['qkv_tok_s'], 1)} | {f(r['llamacpp_tok_s'], 1)} | {f(r['ratio'])} | "
                     f"{f(r['qkv_floor_ms'])} | {f(r['qkv_x_floor'])} | {f(r['llamacpp_x_floor'])} | "
                     f"{f(r['tokens_equal'])} | {f(r['logits_max_diff'], 4)} ({f(r['logits_scale'], 3)}) |")
    return lines


if __name__ == "__main__":
    main()
