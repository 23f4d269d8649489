"""qkv serve under load, CPU, one run, five parts:

1. load   N concurrent streaming clients (asyncio + aiohttp, or --client httpx) on a loopback server, mixed
          prompt lengths and output lengths, greedy; total generated tok/s vs sequential generate() at batch 1
          on the same prompts; p50/p99 time to first token (TTFT) and inter-token latency (ITL); failed /
          truncated / garbled responses (every streamed token sequence is compared with generate() alone).
2. static the same requests through Engine.run() vs one padded generate() batch: tok/s and KV memory
          (engine: peak blocks x block bytes; static: B x (longest prompt + longest output) positions);
          interleaved with the engine whose decoding batch is cut by length (split_cost=4096; the default,
          "auto", cuts it only where the paged step gathers K/V: not on the CPU).
3. prefix 16 requests sharing a 384-token system prompt: prefill tokens computed with prefix caching vs
          without (work saved), same outputs.
4. preemption  the load test's requests on a pool of ~1/3 the blocks they need at once: preemptions and
          recomputed tokens with the least_work and the newest victim policy, same outputs.
5. chunked prefill: a 768-token prompt joins 16 decoding requests: the longest gap between their tokens
          and the newcomer's time to first token, prefill_chunk=256 vs the whole prompt in one step.
6. choices 8 prompts of 384 tokens, 4 samples each (64 new tokens): one request with n=4 (the samples
          forked on the prompt's blocks, copy-on-write) vs four separate requests (seeds s .. s+3: the same
          samples), with and without prefix caching: tok/s, prefill tokens, peak KV blocks (medians of
          --repeats, interleaved).

Models (--family): 'gpt' = qkv's 'gpt-bench' run folder (6 layers, 384 wide, vocab 65, random weights) with a
1024-position table; 'llama' = the 135M-class Llama of benchmarks/llm.py (30 layers, hidden 576, 9 / 3 heads,
vocab 49152, tied; random weights) saved by `transformers` as a Hugging Face folder with a word-level
`tokenizer.json` of its own (no eos, so every request runs to its length). --parts picks the parts to run
(the Llama model is ~6x the GPT's work per token: `--family llama --parts load` is the headline figure).

    .venv/bin/python benchmarks/serve.py [--quick] [--family gpt|llama]
        [--parts load static prefix preempt chunk] [--clients 64] [--prompt-max 512] [--new-max 256]
        [--client aiohttp|httpx]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from qkv.generate import Engine, generate  # noqa: E402
from qkv.generate.engine import TEXT_CONTEXT  # noqa: E402
from qkv.generate.text import decode_continuation  # noqa: E402
from qkv.serve import load_served  # noqa: E402
from qkv.tasks import build_task  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


LLAMA = dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
             intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)
LLAMA_QUICK = dict(LLAMA, num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=512)
PARTS = ("load", "static", "prefix", "preempt", "chunk", "choices")


def make_llama_folder(path: Path, quick: bool) -> Path:
    """A Hugging Face Llama folder as `transformers` writes it, with a word-level tokenizer ('t0' .. 'tN')
    whose token ids are the model's: token-id prompts round-trip through the server's text output."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    spec = LLAMA_QUICK if quick else LLAMA
    cfg = transformers.LlamaConfig(**spec, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(spec["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


def make_folder(path: Path, quick: bool, family: str = "gpt") -> Path:
    if family == "llama":
        return make_llama_folder(path, quick)
    task = build_task("charlm", family="gpt", context=1024)
    kw = dict(n_layers=2, d_model=64, n_heads=2) if quick else {}
    model = task.build_model("gpt-bench", position="learned", **kw)
    task.save(path)
    model.save_pretrained(path)
    return path


async def client(c, url: str, name: str, prompt: list[int], n: int) -> dict:
    """One streaming client over httpx (aiter_lines), --client httpx: heavier than aiohttp, its CPU time
    competes."""
    body = {"model": name, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    text, done, usage = [], False, None
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            ev = json.loads(line[6:])
            stamps.append(time.perf_counter())
            text.append(ev["choices"][0]["text"])
            usage = ev.get("usage") or usage
    return {"t0": t0, "stamps": stamps, "text": "".join(text), "done": done, "usage": usage}


async def aio_client(s, url: str, name: str, prompt: list[int], n: int) -> dict:
    """One streaming client over aiohttp, as vLLM's benchmark_serving load generator: the body's bytes as they
    come, cut into SSE events at blank lines, every `data:` line parsed (JSON) and its text kept; a token's
    time stamp is when the read that completed its event returned. ~3x less client CPU than httpx's
    aiter_lines (the clients share the server's 2 cores)."""
    body = {"model": name, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    text, done, usage, buf = [], False, None, b""
    async with s.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for data in r.content.iter_any():
            now = time.perf_counter()
            *events, buf = (buf + data).split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data: "):
                        continue
                    if line == b"data: [DONE]":
                        done = True
                        continue
                    ev = json.loads(line[6:])
                    stamps.append(now)
                    text.append(ev["choices"][0]["text"])
                    usage = ev.get("usage") or usage
    return {"t0": t0, "stamps": stamps, "text": "".join(text),
            "done": done and not buf.strip(), "usage": usage}


def server_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process so far (Linux /proc; nan elsewhere)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def load_test(folder: Path, prompts: list[list[int]], news: list[int], max_batch: int,
              kind: str = "aiohttp") -> dict:
    """The server runs in its own process (`qkv serve --port 0`), as in use: the clients' event loop does not
    share its interpreter lock."""
    import signal
    import subprocess

    import httpx

    served = load_served(folder)
    cmd = [sys.executable, "-m", "qkv.cli.main", "serve", str(folder), "--port", "0", "--name", "bench",
           "--max-batch-size", str(max_batch), "--max-waiting", str(len(prompts))]
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent / "src")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise RuntimeError(f"qkv serve did not start: {line!r}")
    url = line.split("at ")[1].split()[0].removesuffix("/v1")

    async def all_clients():
        if kind == "httpx":
            limits = httpx.Limits(max_connections=len(prompts) + 1)
            async with httpx.AsyncClient(timeout=3600, limits=limits) as c:  # one client: one connection pool
                return await asyncio.gather(*(client(c, url, "bench", p, n) for p, n in zip(prompts, news)))
        import aiohttp

        conn = aiohttp.TCPConnector(limit=len(prompts) + 1)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as s:
            return await asyncio.gather(*(aio_client(s, url, "bench", p, n) for p, n in zip(prompts, news)))

    warm = {"model": "bench", "prompt": prompts[0][:16], "max_tokens": 4, "temperature": 0}
    # first-call costs, untimed
    httpx.post(url + "/v1/completions", json=warm, timeout=600).raise_for_status()

    t0, c0, s0 = time.perf_counter(), time.process_time(), server_cpu(proc.pid)
    res = asyncio.run(all_clients())
    wall, client_cpu, srv_cpu = time.perf_counter() - t0, time.process_time() - c0, server_cpu(proc.pid) - s0
    metrics = httpx.get(url + "/metrics").text
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)

    def metric(name: str) -> float:
        return next(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(name + " "))

    stats = {"preemptions": metric("qkv_preemptions_total"),
             "prefix_hit_rate": metric("qkv_prefix_cache_hit_rate")}
    # the reference: generate() alone, batch 1, sequentially, on the same prompts
    m = served.model
    t0 = time.perf_counter()
    refs = [generate(m, torch.tensor([p]), n)[0, len(p):].tolist() for p, n in zip(prompts, news)]
    seq_wall = time.perf_counter() - t0
    # the server's text is what the tokens add after the prompt (decoded after its last few tokens,
    # StreamDecoder)
    want = [decode_continuation(served.codec.decode, p[-TEXT_CONTEXT:], ref) for p, ref in zip(prompts, refs)]
    bad = sum(1 for r, w, n in zip(res, want, news)
              if not r["done"] or r["text"] != w or (r["usage"] or {}).get("completion_tokens") != n)
    ttft = [r["stamps"][0] - r["t0"] for r in res if r["stamps"]]
    itl = [b - a for r in res for a, b in zip(r["stamps"], r["stamps"][1:])]
    total = sum(news)
    return {"clients": len(prompts), "generated_tokens": total, "server_s": round(wall, 2),
            "server_tok_s": round(total / wall, 1), "sequential_generate_s": round(seq_wall, 2),
            "sequential_tok_s": round(total / seq_wall, 1), "speedup": round(seq_wall / wall, 2),
            "ttft_p50_s": round(pct(ttft, 0.5), 3), "ttft_p99_s": round(pct(ttft, 0.99), 3),
            "itl_p50_ms": round(1000 * pct(itl, 0.5), 1), "itl_p99_ms": round(1000 * pct(itl, 0.99), 1),
            "failed_or_garbled": bad, "client": kind, "client_cpu_s": round(client_cpu, 2),
            "server_cpu_s": round(srv_cpu, 2), "preemptions": stats["preemptions"], "prefix_hit_rate":
            round(stats["prefix_hit_rate"], 3)}


def engine_vs_static(m, prompts, news, repeats: int) -> dict:
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    c = m.config
    slot = 2 * c.n_layers * c.d_model * 4
    times: dict[str, list[float]] = {"engine": [], "static": [], "engine_split": []}
    mem = {}
    for _ in range(repeats):  # interleaved
        for name, split in (("engine", "auto"), ("engine_split", 4096)):  # split: a forward per length group
            t0 = time.perf_counter()
            e = Engine(m, max_batch_size=len(prompts), split_cost=split)
            rids = [e.add_request(p, n) for p, n in zip(prompts, news)]
            out = e.run()
            times[name].append(time.perf_counter() - t0)
            if name == "engine":
                mem["engine"], kept = e.peak_blocks * e.cache.bytes_per_block, out
        t0 = time.perf_counter()
        ref = generate(m, ids, max(news), attention_mask=mask)
        times["static"].append(time.perf_counter() - t0)
        mem["static"] = len(prompts) * (T + max(news)) * slot
    same = all(kept[r] == out[r] == ref[i, T:T + n].tolist() for i, (r, n) in enumerate(zip(rids, news)))
    med = {k: statistics.median(v) for k, v in times.items()}
    total = sum(news)
    return {"engine_tok_s": round(total / med["engine"], 1), "static_tok_s": round(total / med["static"], 1),
            "engine_over_static": round(med["static"] / med["engine"], 2),
            "engine_split_tok_s": round(total / med["engine_split"], 1),
            "engine_split_over_static": round(med["static"] / med["engine_split"], 2),
            "engine_kv_mib": round(mem["engine"] / 2**20, 1),
            "static_kv_mib": round(mem["static"] / 2**20, 1),
            "kv_ratio": round(mem["engine"] / mem["static"], 2), "same_tokens": same}


def prefix_work(m, system_len: int, n_req: int, new: int) -> dict:
    g = torch.Generator().manual_seed(1)
    V = m.output_vocab_size
    system = torch.randint(0, V, (system_len,), generator=g).tolist()
    prompts = [system + torch.randint(0, V, (int(torch.randint(8, 33, (1,), generator=g)),),
                                      generator=g).tolist()
               for _ in range(n_req)]
    res = {}
    for on in (False, True):
        e = Engine(m, max_batch_size=n_req, prefix_caching=on)
        rids = [e.add_request(p, new) for p in prompts]
        t0 = time.perf_counter()
        out = e.run()
        res[on] = (e.stats()["prefill_tokens"], time.perf_counter() - t0, [out[r] for r in rids])
    saved = 1 - res[True][0] / res[False][0]
    return {"requests": n_req, "system_prompt": system_len, "prefill_tokens_without": res[False][0],
            "prefill_tokens_with": res[True][0], "work_saved": round(saved, 3),
            "wall_without_s": round(res[False][1], 2), "wall_with_s": round(res[True][1], 2),
            "same_tokens": res[True][2] == res[False][2]}


def preemption_policies(m, prompts, news, block_size: int = 16) -> dict:
    """The same requests on a pool of ~1/3 of the blocks they need together: preemptions and the computed
    tokens thrown away under each victim policy (outputs checked equal to a pool without preemption)."""
    need = sum(-(-(len(p) + n) // block_size) for p, n in zip(prompts, news))
    biggest = max(-(-(len(p) + n) // block_size) for p, n in zip(prompts, news))
    blocks = max(biggest + 2, need // 3)
    ref = Engine(m, max_batch_size=len(prompts))
    rids = [ref.add_request(p, n) for p, n in zip(prompts, news)]
    want = ref.run()
    out = {"blocks": blocks, "blocks_needed_all_at_once": need}
    for policy in ("least_work", "newest"):
        e = Engine(m, num_blocks=blocks, max_batch_size=len(prompts), preemption=policy)
        ids = [e.add_request(p, n) for p, n in zip(prompts, news)]
        t0 = time.perf_counter()
        got = e.run()
        st = e.stats()
        out[policy] = {"preemptions": st["preemptions"], "recomputed_tokens": st["recomputed_tokens"],
                       "prefill_tokens": st["prefill_tokens"], "wall_s": round(time.perf_counter() - t0, 2),
                       "same_tokens": [got[i] for i in ids] == [want[r] for r in rids]}
    return out


def chunked_prefill(m, long_len: int, running: int = 16, chunk: int = 256) -> dict:
    """`running` requests are decoding when a `long_len`-token prompt arrives: the longest gap between two
    tokens of a running request, and the long request's time to first token, with chunked prefill
    (prefill_chunk=chunk) and with the whole prompt in one step (prefill_chunk=None)."""
    g = torch.Generator().manual_seed(2)
    V = m.output_vocab_size
    long_prompt = torch.randint(0, V, (long_len,), generator=g).tolist()
    out = {"running": running, "long_prompt": long_len, "chunk": chunk}
    for name, c in (("chunked", chunk), ("whole", None)):
        e = Engine(m, max_batch_size=running + 1, prefill_chunk=c)
        for _ in range(running):
            e.add_request(torch.randint(0, V, (16,), generator=g).tolist(), 200)  # still running at the end
        for _ in range(3):
            e.step()  # everyone is decoding
        rid = e.add_request(long_prompt, 4)
        t_add = time.perf_counter()
        gaps, ttft = [], None
        while ttft is None:
            t0 = time.perf_counter()
            events = e.step()
            gaps.append(time.perf_counter() - t0)
            if any(r == rid for r, _ in events):
                ttft = time.perf_counter() - t_add
        out[name] = {"max_gap_ms": round(1000 * max(gaps), 1), "steps": len(gaps), "ttft_s": round(ttft, 3)}
    return out


def parallel_samples(m, n_prompts: int, prompt_len: int, new: int, repeats: int, n: int = 4) -> dict:
    """n samples of each prompt: one request with n=n vs n separate requests seeded seed .. seed + n - 1
    (the samples the n=n request's choices are), with the prefix cache on (the separate requests then share
    the prompt's full blocks too) and off."""
    g = torch.Generator().manual_seed(3)
    V = m.output_vocab_size
    prompts = [torch.randint(0, V, (prompt_len,), generator=g).tolist() for _ in range(n_prompts)]
    cfg = dict(max_new_tokens=new, do_sample=True)
    times: dict[str, list[float]] = {}
    stats, outs = {}, {}
    for _ in range(repeats):  # interleaved
        for name, forked, cache in (("forked", True, True), ("separate", False, True),
                                    ("separate_no_cache", False, False)):
            e = Engine(m, max_batch_size=n_prompts * n, prefix_caching=cache)
            t0 = time.perf_counter()
            if forked:
                firsts = [e.add_request(p, seed=10 * i, n=n, **cfg) for i, p in enumerate(prompts)]
                rids = [r + j for r in firsts for j in range(n)]  # a request's choices: ids r .. r + n - 1
            else:
                rids = [e.add_request(p, seed=10 * i + j, **cfg) for i, p in enumerate(prompts)
                        for j in range(n)]
            out = e.run()
            times.setdefault(name, []).append(time.perf_counter() - t0)
            st = e.stats()
            stats[name] = {"prefill_tokens": st["prefill_tokens"], "peak_blocks": e.peak_blocks,
                           "cow_copies": st["cow_copies"]}
            outs[name] = [out[r] for r in rids]
    total = n_prompts * n * new
    res = {"prompts": n_prompts, "prompt_len": prompt_len, "samples": n, "new_tokens": new,
           "same_tokens": outs["forked"] == outs["separate"] == outs["separate_no_cache"]}
    for name, ts in times.items():
        res[name] = {"tok_s": round(total / statistics.median(ts), 1), **stats[name]}
    med = {k: statistics.median(v) for k, v in times.items()}
    res["forked_over_separate"] = round(med["separate"] / med["forked"], 2)
    res["forked_over_separate_no_cache"] = round(med["separate_no_cache"] / med["forked"], 2)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a CPU smoke run (tiny model, few clients)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--new-max", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--family", choices=["gpt", "llama"], default="gpt")
    ap.add_argument("--client", choices=["aiohttp", "httpx"], default="aiohttp",
                    help="the load generator's HTTP client (httpx: heavier, its CPU time competes with the "
                         "server)")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serve[_llama].json)")
    a = ap.parse_args()
    if a.quick:
        a.clients, a.prompt_max, a.new_max, a.repeats = 6, 40, 16, 1
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    rnd = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    a.out = a.out or str(ROOT / "results" / ("serve.json" if a.family == "gpt" else f"serve_{a.family}.json"))
    vocab = (LLAMA_QUICK if a.quick else LLAMA)["vocab_size"] if a.family == "llama" else 65
    prompts = [torch.randint(0, vocab, (rnd(16, a.prompt_max),), generator=g).tolist()
                   for _ in range(a.clients)]
    news = [rnd(16, a.new_max) for _ in range(a.clients)]
    run = set(a.parts)
    result: dict = {"family": a.family, "threads": torch.get_num_threads(), "quick": a.quick}
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_folder(Path(tmp) / "model", a.quick, a.family)
        if "load" in run:
            result["load"] = load_test(folder, prompts, news, max_batch=a.clients, kind=a.client)
        m = load_served(folder).model
        if "static" in run:
            result["engine_vs_static"] = engine_vs_static(m, prompts, news, a.repeats)
        if "prefix" in run:
            result["prefix_caching"] = prefix_work(m, 64 if a.quick else 384, 4 if a.quick else 16,
                                                   8 if a.quick else 32)
        if "preempt" in run:
            result["preemption"] = preemption_policies(m, prompts, news)
        if "chunk" in run:
            result["chunked_prefill"] = chunked_prefill(m, 64 if a.quick else 768, 4 if a.quick else 16,
                                                        16 if a.quick else 256)
        if "choices" in run:
            result["choices"] = parallel_samples(m, 2 if a.quick else 8, 40 if a.quick else 384,
                                                 8 if a.quick else 64, a.repeats)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    report(result)
    print(f"wrote {a.out}")


def report(result: dict) -> None:
    print(f"model: {result['family']}")
    if "load" in result:
        load = result["load"]
        print(f"| clients | tok/s server | tok/s sequential generate() | speedup | TTFT p50 / p99 (s) | "
              "ITL p50 / p99 (ms) | failed | server / client CPU (s) "
              f"|\n|---|---|---|---|---|---|---|---|\n| {load['clients']} ({load.get('client', 'httpx')}) | "
              f"{load['server_tok_s']} | {load['sequential_tok_s']} | {load['speedup']}x | "
              f"{load['ttft_p50_s']} / {load['ttft_p99_s']} | {load['itl_p50_ms']} / {load['itl_p99_ms']} | "
              f"{load['failed_or_garbled']} | {load.get('server_cpu_s')} / {load.get('client_cpu_s')} |\n")
    if static := result.get("engine_vs_static"):
        print(f"engine {static['engine_tok_s']} tok/s vs static padded {static['static_tok_s']} tok/s "
              f"({static['engine_over_static']}x) at {static['kv_ratio']}x its KV memory "
              f"({static['engine_kv_mib']} vs {static['static_kv_mib']} MiB); same tokens: "
              f"{static['same_tokens']}; decoding batch cut by length (split_cost=4096): "
              f"{static['engine_split_tok_s']} tok/s ({static['engine_split_over_static']}x)")
    if prefix := result.get("prefix_caching"):
        print(f"prefix caching, {prefix['requests']} requests sharing a {prefix['system_prompt']}-token "
              f"prompt: prefill {prefix['prefill_tokens_with']} vs {prefix['prefill_tokens_without']} "
              f"tokens, work saved {prefix['work_saved']:.0%}; same tokens: {prefix['same_tokens']}")
    if preempt := result.get("preemption"):
        for policy in ("least_work", "newest"):
            p = preempt[policy]
            print(f"preemption {policy}: {p['preemptions']} preemptions, {p['recomputed_tokens']} computed "
                  f"tokens thrown away, {p['wall_s']} s ({preempt['blocks']} of "
                  f"{preempt['blocks_needed_all_at_once']} blocks); same tokens: {p['same_tokens']}")
    if chunk := result.get("chunked_prefill"):
        print(f"a {chunk['long_prompt']}-token prompt joining {chunk['running']} decoding requests: longest "
              f"gap between their tokens {chunk['chunked']['max_gap_ms']} ms chunked ({chunk['chunk']} per "
              f"step) vs {chunk['whole']['max_gap_ms']} ms whole; its first token after "
              f"{chunk['chunked']['ttft_s']} vs {chunk['whole']['ttft_s']} s")
    if ch := result.get("choices"):
        n = ch["samples"]
        print(f"{ch['prompts']} prompts of {ch['prompt_len']} tokens x {n} samples of "
              f"{ch['new_tokens']} tokens; same samples: {ch['same_tokens']}\n"
              "| | tok/s | prefill tokens | peak KV blocks | copy-on-write copies |\n|---|---|---|---|---|")
        for name, label in (("forked", f"n={n}"), ("separate", f"{n} requests, prefix cache"),
                            ("separate_no_cache", f"{n} requests, no prefix cache")):
            r = ch[name]
            print(f"| {label} | {r['tok_s']} | {r['prefill_tokens']} | {r['peak_blocks']} | "
                  f"{r['cow_copies']} |")
        print(f"n={n} is {ch['forked_over_separate']}x as fast as separate requests "
              f"({ch['forked_over_separate_no_cache']}x without the prefix cache)")


if __name__ == "__main__":
    main()
