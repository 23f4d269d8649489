"""Interleaved A/B of the serving path on benchmarks/serve.py's load (issue 13, srv13d).

Each round runs, in turn: `qkv serve` from each given source tree (its own process, PYTHONPATH=tree) under the
same streaming clients (benchmarks/serve.py's aio_client(), or client() with --client httpx: 64 SSE streams,
every event parsed), and, with
--engine, Engine.run() in this process on the same requests (the ceiling a server can reach). Reports wall
tok/s, the server process's CPU seconds, medians over rounds, ratios to the first tree, and whether every
stream's text equals the decoded Engine output.

    OMP_NUM_THREADS=2 .venv/bin/python docs/perf/srv13d/ab_serve.py old=/tmp/old/src new=src --engine \\
        --rounds 3 [--clients 64 --prompt-max 512 --new-max 256] [--tiny] --out docs/perf/srv13d/ab_serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

import httpx  # noqa: E402
import torch  # noqa: E402

import serve as bench  # noqa: E402  benchmarks/serve.py
from qkv.generate import Engine  # noqa: E402
from qkv.serve import load_served  # noqa: E402


def run_server(src: str, folder: Path, prompts, news, kind: str) -> dict:
    cmd = [sys.executable, "-m", "qkv.cli.main", "serve", str(folder), "--port", "0", "--name", "bench",
           "--max-batch-size", str(len(prompts)), "--max-waiting", str(len(prompts))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": src})
    line = proc.stdout.readline()
    url = line.split("at ")[1].split()[0].removesuffix("/v1")
    httpx.post(url + "/v1/completions", json={"model": "bench", "prompt": prompts[0][:16], "max_tokens": 4,
                                              "temperature": 0}, timeout=600).raise_for_status()

    async def clients():
        if kind == "httpx":
            async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=len(prompts) + 1)) as c:
                return await asyncio.gather(*(bench.client(c, url, "bench", p, n) for p, n in zip(prompts, news)))
        import aiohttp

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=len(prompts) + 1)) as s:
            return await asyncio.gather(*(bench.aio_client(s, url, "bench", p, n) for p, n in zip(prompts, news)))

    stat0 = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    t0, c0 = time.perf_counter(), time.process_time()
    res = asyncio.run(clients())
    wall, client_cpu = time.perf_counter() - t0, time.process_time() - c0
    stat1 = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    cpu = (int(stat1[11]) + int(stat1[12]) - int(stat0[11]) - int(stat0[12])) / tick  # utime + stime, the load only
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    return {"wall": wall, "cpu": cpu, "client_cpu": client_cpu, "texts": [r["text"] for r in res], "done": all(r["done"] for r in res)}


def run_engine(m, prompts, news) -> dict:
    c0, t0 = time.process_time(), time.perf_counter()
    e = Engine(m, max_batch_size=len(prompts))
    rids = [e.add_request(p, n) for p, n in zip(prompts, news)]
    out = e.run()
    return {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0, "ids": [out[r] for r in rids]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="+", help="name=path/to/src")
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--new-max", type=int, default=256)
    ap.add_argument("--client", choices=["aiohttp", "httpx"], default="aiohttp")
    ap.add_argument("--tiny", action="store_true",
                    help="benchmarks/serve.py's --quick model (2 layers, 64 wide): the HTTP/streaming cost dominates")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    trees = dict(t.split("=", 1) for t in a.trees)
    trees = {k: str(Path(v).resolve()) for k, v in trees.items()}
    g = torch.Generator().manual_seed(0)  # benchmarks/serve.py's requests
    rnd = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    prompts = [torch.randint(0, 65, (rnd(16, a.prompt_max),), generator=g).tolist() for _ in range(a.clients)]
    news = [rnd(16, a.new_max) for _ in range(a.clients)]
    total = sum(news)
    times: dict[str, list] = {k: [] for k in [*trees, *(["engine"] if a.engine else [])]}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        folder = bench.make_folder(Path(tmp) / "model", a.tiny)
        served = load_served(folder)
        ref = run_engine(served.model, prompts, news)["ids"]  # warm-up and the reference texts
        want = [served.codec.decode(r) for r in ref]
        for rnd_i in range(a.rounds):
            for name, src in trees.items():
                r = run_server(src, folder, prompts, news, a.client)
                ok &= r["done"] and r["texts"] == want
                times[name].append((r["wall"], r["cpu"]))
                print(f"round {rnd_i} {name}: {total / r['wall']:.1f} tok/s, server CPU {r['cpu']:.1f} s, clients' CPU "
                      f"{r['client_cpu']:.1f} s", flush=True)
            if a.engine:
                r = run_engine(served.model, prompts, news)
                ok &= r["ids"] == ref
                times["engine"].append((r["wall"], r["cpu"]))
                print(f"round {rnd_i} engine: {total / r['wall']:.1f} tok/s, CPU {r['cpu']:.1f} s", flush=True)
    first = next(iter(trees))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    rows = {k: {"tok_s": round(total / w, 1), "cpu_s": round(c, 1), "wall_s": round(w, 2),
                "speed_vs_" + first: round(med[first][0] / w, 3), "cpu_vs_" + first: round(med[first][1] / c, 3),
                "runs": [[round(w, 2), round(c, 2)] for w, c in times[k]]} for k, (w, c) in med.items()}
    result = {"model": "tiny" if a.tiny else "gpt-bench", "clients": a.clients, "client": a.client, "prompt_max": a.prompt_max, "new_max": a.new_max, "generated_tokens": total,
              "rounds": a.rounds, "threads": torch.get_num_threads(), "same_text_everywhere": ok, "rows": rows}
    print(f"| arm | tok/s (wall) | CPU s | vs {first} (wall) | vs {first} (CPU) |\n|---|---|---|---|---|")
    for k, r in rows.items():
        print(f"| {k} | {r['tok_s']} | {r['cpu_s']} | {r['speed_vs_' + first]}x | {r['cpu_vs_' + first]}x |")
    print(f"{a.clients} clients, {total} tokens, medians of {a.rounds} interleaved rounds; same text: {ok}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
