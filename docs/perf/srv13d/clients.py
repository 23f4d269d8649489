# ruff: noqa  (a one-off measurement script, kept as it ran)
"""Client CPU of three SSE load generators against one `qkv serve` (the --quick tiny model), 64 streams x 200
tokens, interleaved: httpx aiter_lines (benchmarks/serve.py's client before srv13d), httpx aiter_bytes with
our own SSE split, aiohttp iter_any (as vLLM's benchmark_serving). Same texts checked.

    OMP_NUM_THREADS=1 .venv/bin/python docs/perf/srv13d/clients.py
"""
import asyncio, json, os, subprocess, sys, tempfile, time, signal  # noqa: E401
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks")); sys.path.insert(0, str(ROOT / "src"))  # noqa: E702
import serve as B, httpx, aiohttp  # noqa: E401, E402
N, NEW = 64, 200
folder = B.make_folder(Path(tempfile.mkdtemp()) / "tiny", True)
cmd = [sys.executable, "-m", "qkv.cli.main", "serve", str(folder), "--port", "0", "--name", "bench", "--max-batch-size", "64"]
proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
url = proc.stdout.readline().split("at ")[1].split()[0].removesuffix("/v1")
prompts = [[1 + i % 50] * 20 for i in range(N)]

async def c_bytes(c, p):
    body = {"model": "bench", "prompt": p, "max_tokens": NEW, "temperature": 0, "stream": True}
    text, stamps, buf, done = [], [], b"", False
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        async for data in r.aiter_bytes():
            buf += data
            *events, buf = buf.split(b"\n\n")
            now = time.perf_counter()
            for ev in events:
                if ev == b"data: [DONE]": done = True; continue
                text.append(json.loads(ev[6:])["choices"][0]["text"]); stamps.append(now)
    return "".join(text)

async def c_aio(s, p):
    body = {"model": "bench", "prompt": p, "max_tokens": NEW, "temperature": 0, "stream": True}
    text, stamps, buf = [], [], b""
    async with s.post(url + "/v1/completions", json=body) as r:
        async for data in r.content.iter_any():
            buf += data
            *events, buf = buf.split(b"\n\n")
            now = time.perf_counter()
            for ev in events:
                if ev == b"data: [DONE]": continue
                text.append(json.loads(ev[6:])["choices"][0]["text"]); stamps.append(now)
    return "".join(text)

async def run(kind):
    if kind == "aiohttp":
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=N + 1), timeout=aiohttp.ClientTimeout(total=3600)) as s:
            return await asyncio.gather(*(c_aio(s, p) for p in prompts))
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=N + 1)) as c:
        if kind == "lines":
            return [r["text"] for r in await asyncio.gather(*(B.client(c, url, "bench", p, NEW) for p in prompts))]
        return await asyncio.gather(*(c_bytes(c, p) for p in prompts))
ref = None
for rnd in range(2):
    for kind in ("lines", "bytes", "aiohttp"):
        c0, t0 = time.process_time(), time.perf_counter()
        out = asyncio.run(run(kind))
        ref = ref or out
        print(kind, "client cpu", round(time.process_time() - c0, 2), "wall", round(time.perf_counter() - t0, 2), "same", out == ref, flush=True)
proc.send_signal(signal.SIGTERM); proc.wait(60)
