"""`qkv explore` on a GPT-2-small-shaped model: how long the API takes, how big its JSON is, and how long the
page takes to draw, by input length. Tells up to which length the page is pleasant to use.

Model: the `gpt2` preset (12 layers x 12 heads, d 768, 124M parameters) with random weights (nothing is
downloaded), saved to a temporary folder and served by the explorer's app on an ephemeral 127.0.0.1 port.
Inputs: T token ids. For each T, interleaved across T in every round:
  - server: POST /api/analyze latency (client-measured, includes JSON encoding) and response bytes;
  - browser (headless Chromium, when installed): from the click on "Show attention" until the heat map of
    the selected head has T x T cells (request + JSON parse + drawing the thumbnails, heat map and lines).
Also /api/generate with 16 new tokens after a 16-token prompt. Medians over --repeats rounds.

    .venv/bin/python benchmarks/explore.py [--repeats 3] [--lengths 16 64 128 200]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def serve(folder: Path):
    import uvicorn

    from qkv.explore import create_app, load

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(load(folder)), log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    for _ in range(600):
        if server.started:
            break
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/", server


def main() -> None:
    import httpx

    import qkv

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 128, 200])
    a = ap.parse_args()
    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp())
    folder = qkv.build("gpt2").save_pretrained(tmp / "gpt2")
    url, server = serve(folder)
    inputs = {T: " ".join(str((7 * i) % 50000) for i in range(T)) for T in a.lengths}
    api: dict[int, list[float]] = {T: [] for T in a.lengths}
    page: dict[int, list[float]] = {T: [] for T in a.lengths}
    size: dict[int, int] = {}
    gen: list[float] = []
    chromium = shutil.which("chromium")
    pw = ctx = None
    if chromium:
        from playwright.sync_api import sync_playwright

        pw = sync_playwright().start()
        ctx = pw.chromium.launch_persistent_context(str(tmp / "profile"), executable_path=chromium,
                                                    args=FLAGS, viewport={"width": 1280, "height": 1000})
        pg = ctx.new_page()
        pg.goto(url)
        pg.wait_for_function("window.QKV && window.QKV.info")
    with httpx.Client(timeout=600) as client:
        client.post(url + "api/analyze", json={"input": inputs[a.lengths[0]]})  # warm-up
        for _ in range(a.repeats):
            for T in a.lengths:
                t0 = time.perf_counter()
                r = client.post(url + "api/analyze", json={"input": inputs[T]})
                api[T].append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
                size[T] = len(r.content)
                if ctx is not None:
                    pg.evaluate("() => { for (const id of ['heatmap','overview']) "
                                "document.getElementById(id).replaceChildren(); }")
                    pg.fill("#input", inputs[T])
                    t0 = time.perf_counter()
                    pg.click("#analyze")
                    pg.wait_for_function("document.querySelectorAll('#heatmap rect.cell').length === "
                                         f"{T * T}",
                                         timeout=600_000)
                    page[T].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            r = client.post(url + "api/generate", json={"input": inputs[a.lengths[0]], "max_new_tokens": 16})
            gen.append(time.perf_counter() - t0)
            gen_bytes = len(r.content)
    if ctx is not None:
        ctx.close()
        pw.stop()
    server.should_exit = True
    rows = [{"tokens": T, "weights": 12 * 12 * T * T, "api_s": round(statistics.median(api[T]), 3),
             "json_mb": round(size[T] / 1e6, 2),
             "page_s": round(statistics.median(page[T]), 3) if page[T] else None} for T in a.lengths]
    lines = ["| tokens | attention weights | /api/analyze (s) | JSON (MB) | click to drawn in Chromium (s) |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['weights']:,} | {r['api_s']} | {r['json_mb']} | "
                     f"{r['page_s'] if r['page_s'] is not None else '-'} |")
    lines.append("")
    lines.append(f"/api/generate, 16-token prompt + 16 new tokens: {statistics.median(gen):.3f} s, "
                 f"{gen_bytes / 1e6:.2f} MB")
    table = "\n".join(lines)
    meta = {"model": "gpt2 preset, random weights (124M)", "repeats": a.repeats, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "machine": platform.processor(), "chromium": bool(chromium)}
    out = ROOT / "results"
    out.mkdir(exist_ok=True)
    (out / "explore.json").write_text(json.dumps({"meta": meta, "rows": rows, "generate_s": gen}, indent=2))
    (out / "explore.md").write_text(table + "\n")
    print(table)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
