"""The --quick CPU smoke form of benchmarks/serve.py: it runs end to end, every streamed response equals
generate() alone, the engine gives the static batch's tokens, and prefix caching saves prefill work."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_serve_benchmark_quick(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "serve.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["load"]["failed_or_garbled"] == 0 and res["load"]["clients"] == 6
    assert res["engine_vs_static"]["same_tokens"] and res["prefix_caching"]["same_tokens"]
    assert res["prefix_caching"]["work_saved"] > 0.5  # 4 requests, 64 shared tokens: 3 of 4 prefixes reused
    for policy in ("least_work", "newest"):
        assert res["preemption"][policy]["same_tokens"]
    # n=4 draws the samples of four requests seeded s .. s+3, computing each prompt once
    choices = res["choices"]
    assert choices["same_tokens"] and choices["forked"]["prefill_tokens"] == 2 * 40
    assert choices["separate_no_cache"]["prefill_tokens"] == 4 * 2 * 40


def test_serve_benchmark_quick_llama_folder(tmp_path):
    """The Llama form: a Hugging Face folder with a tokenizer.json served over HTTP; streamed text equals
    generate() alone for every client."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "serve_llama.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--quick", "--family", "llama",
                        "--parts", "load", "static", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["family"] == "llama" and "prefix_caching" not in res
    assert res["load"]["failed_or_garbled"] == 0 and res["load"]["clients"] == 6
    assert res["engine_vs_static"]["same_tokens"]
