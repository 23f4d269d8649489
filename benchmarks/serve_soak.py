"""A serving soak: `qkv serve` on a tiny LLaVA folder under mixed traffic for a set time, watched for slow
leaks.

The server runs in its own process on 127.0.0.1 (loopback only), as in use. `--clients` concurrent clients
send requests until `--minutes` have passed or `--max-requests` were sent, each request drawn (seeded) from:

  plain      chat, text only, not streamed
  stream     chat, text only, streamed to the end
  cancel     chat, streamed, the connection closed after the first chunk (a client that goes away)
  image      chat with a PNG data: URL: one of 8 repeated images (embedding LRU and prefix-cache hits)
  new_image  chat with an image never sent before (the LRU evicts; the prefix cache fills with new content)
  image_gone an image request whose connection is closed before the answer (a client gone mid-image)
  hostile    a request the server must refuse: a decompression-bomb PNG (400), a body over
             --max-request-bytes (413), an http image URL (400), more images than --max-images (400)

Sampled at the start (after one warm-up request of each kind), every `--every` seconds, and after the
clients stop and the server drains: the server's resident memory (VmRSS), open file descriptors, threads,
KV blocks in use and cached, image-cache entries, and the number of metric series /metrics returns (label
sets that grow per request would show there). Also counted: requests per kind, unexpected answers (a 5xx,
a refusal that is not the expected 4xx, a stream without [DONE]) -- the soak's failures.

    .venv/bin/python benchmarks/serve_soak.py --minutes 30            # the full soak
    .venv/bin/python benchmarks/serve_soak.py --minutes 1 --every 20  # a short one

Writes benchmarks/results/serve_soak.json and .md (or --out). Flat after warm-up is the bar: the table shows
each figure at start, its largest value, and after drain.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests" / "interop"))  # the tests' tiny random-weight LLaVA folder builder
from _llava_folder import llava_folder  # noqa: E402

KINDS = ("plain", "stream", "cancel", "image", "new_image", "image_gone", "hostile")
WEIGHTS = (3, 3, 2, 3, 2, 1, 1)
QUESTION = "what is in the picture?"


def png_url(seed: int, size: int = 40) -> str:
    """A PNG data: URL of random pixels (seeded)."""
    from PIL import Image

    rng = random.Random(seed)
    im = Image.frombytes("RGB", (size, size), bytes(rng.randrange(256) for _ in range(size * size * 3)))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def bomb_url(side: int = 60_000) -> str:
    """A PNG of a few hundred bytes that declares side x side pixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def chat(text: str, images: list[str] = (), stream: bool = False, max_tokens: int = 8) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in images]
    content = [{"type": "text", "text": text}, *parts]
    return {"model": "soak", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.7, "stream": stream}


class Soak:
    """The clients' shared state: what was sent, what went wrong."""

    def __init__(self, url: str, seed: int, max_request_bytes: int, max_images: int) -> None:
        self.url, self.rng = url, random.Random(seed)
        self.repeated = [png_url(i) for i in range(8)]
        self.fresh = 10_000
        self.bomb = bomb_url()
        self.oversized = "x" * (max_request_bytes + 1)
        self.max_images = max_images
        self.sent = dict.fromkeys(KINDS, 0)
        self.failures: list[str] = []

    def fail(self, kind: str, why: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(f"{kind}: {why}"[:300])

    async def one(self, c: httpx.AsyncClient, kind: str) -> None:
        self.sent[kind] += 1
        post = self.url + "/v1/chat/completions"
        if kind == "plain":
            await self.expect(c, post, chat(QUESTION), 200, kind)
        elif kind == "stream":
            async with c.stream("POST", post, json=chat(QUESTION, stream=True)) as r:
                text = "".join([line async for line in r.aiter_lines()])
                if r.status_code != 200 or "data: [DONE]" not in text:
                    self.fail(kind, f"{r.status_code}, [DONE] {'data: [DONE]' in text}")
        elif kind == "cancel":
            async with c.stream("POST", post, json=chat(QUESTION, stream=True, max_tokens=64)) as r:
                async for _ in r.aiter_lines():
                    break  # the connection closes with the context: the server must cancel the request
        elif kind == "image_gone":  # gone while the server decodes, embeds or prefills the image
            try:
                await asyncio.wait_for(c.post(post, json=chat(QUESTION, [self.new_image()])), 0.05)
            except asyncio.TimeoutError:
                pass
        elif kind == "image":
            await self.expect(c, post, chat(QUESTION, [self.rng.choice(self.repeated)]), 200, kind)
        elif kind == "new_image":
            await self.expect(c, post, chat(QUESTION, [self.new_image()]), 200, kind)
        else:
            await self.hostile(c, post)

    def new_image(self) -> str:
        self.fresh += 1
        return png_url(self.fresh)

    async def hostile(self, c: httpx.AsyncClient, post: str) -> None:
        which = self.rng.randrange(4)
        if which == 0:
            await self.expect(c, post, chat(QUESTION, [self.bomb]), 400, "hostile bomb")
        elif which == 1:
            await self.expect(c, post, chat(self.oversized), 413, "hostile oversized")
        elif which == 2:
            await self.expect(c, post, chat(QUESTION, ["http://127.0.0.1:9/x.png"]), 400, "hostile http url")
        else:
            await self.expect(c, post, chat(QUESTION, self.repeated[:1] * (self.max_images + 1)), 400,
                              "hostile too many images")

    async def expect(self, c: httpx.AsyncClient, url: str, body: dict, status: int, kind: str) -> None:
        r = await c.post(url, json=body)
        if r.status_code != status:
            self.fail(kind, f"{r.status_code} (expected {status}): {r.text[:200]}")


def sample(pid: int, url: str, t0: float, label: str) -> dict:
    """The server process's resources and the engine's gauges now."""
    status = Path(f"/proc/{pid}/status").read_text()
    field = dict(x.split(":", 1) for x in status.splitlines() if ":" in x)
    text = httpx.get(url + "/metrics", timeout=60).text
    series = [x for x in text.splitlines() if x and not x.startswith("#")]

    def metric(name: str) -> float:
        found = (float(x.split()[-1]) for x in series if x.split("{")[0].split()[0] == name)
        return next(found, float("nan"))

    return {"at": label, "t_s": round(time.monotonic() - t0, 1),
            "rss_mb": round(int(field["VmRSS"].split()[0]) / 1024, 1),
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(field["Threads"]), "kv_blocks_used": metric("qkv_kv_blocks_used"),
            "kv_blocks_cached": metric("qkv_kv_blocks_cached"),
            "image_cache_entries": metric("qkv_image_cache_entries"), "metric_series": len(series),
            "requests_running": metric("qkv_num_requests_running")}


async def clients(soak: Soak, n: int, deadline: float, max_requests: int) -> None:
    kinds = iter(lambda: soak.rng.choices(KINDS, WEIGHTS)[0], None)
    budget = [max_requests]

    async def client(c: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline and budget[0] > 0:
            budget[0] -= 1
            kind = next(kinds)
            try:
                await soak.one(c, kind)
            except httpx.HTTPError as e:
                soak.fail(kind, f"{type(e).__name__}: {e}")

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n + 1)) as c:
        await asyncio.gather(*(client(c) for _ in range(n)))


def start_server(folder: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "qkv.cli.main", "serve", str(folder), "--host", "127.0.0.1", "--port", "0",
           "--name", "soak", "--max-batch-size", "4", "--block-size", "8", "--image-cache", "8",
           "--max-request-bytes", str(args.max_request_bytes), "--max-images", str(args.max_images)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise RuntimeError(f"qkv serve did not start: {line!r}")
    return proc, line.split("at ")[1].split()[0].removesuffix("/v1")


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = llava_folder(Path(tmp) / "llava")
        proc, url = start_server(folder, args)
        try:
            return soak(proc, url, args)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


def soak(proc: subprocess.Popen, url: str, args: argparse.Namespace) -> dict:
    s = Soak(url, args.seed, args.max_request_bytes, args.max_images)
    t0 = time.monotonic()
    for kind in KINDS:  # warm-up: first-call costs (vision tower, template) out of the start figures
        asyncio.run(clients_of_kind(s, kind))
    samples = [sample(proc.pid, url, t0, "start")]
    end = t0 + 60 * args.minutes
    while time.monotonic() < end and sum(s.sent.values()) < args.max_requests:
        window = min(end, time.monotonic() + args.every)
        asyncio.run(clients(s, args.clients, window, args.max_requests - sum(s.sent.values())))
        samples.append(sample(proc.pid, url, t0, f"{(time.monotonic() - t0) / 60:.1f} min"))
    drained = time.monotonic() + 30
    while sample(proc.pid, url, t0, "")["requests_running"] and time.monotonic() < drained:
        time.sleep(0.5)
    samples.append(sample(proc.pid, url, t0, "after drain"))
    return {"minutes": args.minutes, "clients": args.clients, "seed": args.seed, "sent": s.sent,
            "requests": sum(s.sent.values()), "failures": s.failures, "samples": samples}


async def clients_of_kind(s: Soak, kind: str) -> None:
    async with httpx.AsyncClient(timeout=600) as c:
        try:
            await s.one(c, kind)
        except httpx.HTTPError as e:
            s.fail(kind, f"{type(e).__name__}: {e}")


COLUMNS = ("rss_mb", "fds", "threads", "kv_blocks_used", "kv_blocks_cached", "image_cache_entries",
           "metric_series")


def markdown(result: dict) -> str:
    rows = ["| at | t (s) | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    rows += [f"| {x['at']} | {x['t_s']} | " + " | ".join(str(x[c]) for c in COLUMNS) + " |"
             for x in result["samples"]]
    sent = ", ".join(f"{k} {v}" for k, v in result["sent"].items())
    return (f"serve soak: {result['minutes']} min, {result['clients']} clients, {result['requests']} "
            f"requests ({sent}); unexpected answers: {len(result['failures'])}\n\n" + "\n".join(rows) + "\n"
            + "".join(f"\n- {f}" for f in result["failures"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="how long the clients send requests")
    ap.add_argument("--every", type=float, default=60.0, help="seconds between samples")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients")
    ap.add_argument("--max-requests", type=int, default=100_000, help="stop after this many requests")
    ap.add_argument("--max-request-bytes", type=int, default=1 << 20, help="the server's --max-request-bytes")
    ap.add_argument("--max-images", type=int, default=4, help="the server's --max-images")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "results"), help="folder for serve_soak.json / .md")
    args = ap.parse_args()
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_soak.json").write_text(json.dumps(result, indent=1))
    (out / "serve_soak.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
