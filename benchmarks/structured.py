"""Structured output's cost per token, CPU, one run, two parts:

1. engines  the three grammar engines qkv could use, on the same tokenizer and the same valid JSON answer:
            llguidance (what qkv uses), outlines-core and xgrammar (each where installed; xgrammar's wheel
            needs torch and pulls triton, so it is not one of qkv's dependencies: install it apart, e.g.
            `pip install --no-deps --target DIR xgrammar apache-tvm-ffi` and --xgrammar-path DIR). Per
            grammar: the time to compile it (first mask included: what a request waits before its first
            token) and the median time per token of "next mask + accept the token", walking the answer's
            tokens. Grammars: a nested JSON schema (an order: customer, items, enum, bounds) and any JSON
            object (response_format json_object).
2. engine   qkv's paged Engine, greedy, a batch of requests under the schema's grammar vs the same requests
            unconstrained for the same number of tokens (no eos): tok/s side by side, and the difference
            per token, which is the mask's cost in the generation path (GrammarMask: matcher + bitmask +
            masked_fill, one row at a time).

The tokenizer: a byte-level BPE of --vocab tokens (default 32000, a Llama-2-sized vocabulary) trained here on
the Python standard library's sources (nothing is downloaded); the model of part 2: a random GPT-2 of 4
layers, 256 wide, over that vocabulary. Medians of --repeats interleaved rounds; a shared machine slows all
contenders alike, so read the ratios.

    .venv/bin/python benchmarks/structured.py [--quick] [--vocab 32000] [--repeats 5]
        [--engines llguidance outlines-core xgrammar] [--xgrammar-path DIR] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
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

from _timing import interleaved, write_results  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "customer": {"type": "object",
                     "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                     "required": ["name", "email"], "additionalProperties": False},
        "items": {"type": "array", "items": {
            "type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"},
                                             "price": {"type": "number"}},
            "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "status": {"enum": ["open", "paid", "shipped"]},
        "note": {"type": "string"},
    },
    "required": ["id", "customer", "items", "status", "note"],
    "additionalProperties": False,
}
ANSWER = {"id": 40213, "customer": {"name": "Ada Lovelace", "email": "ada@example.org"},
          "items": [{"sku": "QKV-001", "qty": 2, "price": 19.5}, {"sku": "ATTN-42", "qty": 1, "price": 7.25},
                    {"sku": "LORA-7", "qty": 3, "price": 120.0}],
          "status": "paid", "note": "leave the parcel with the neighbour, please; ring twice"}
# part 2's schema: the same shape with bounds, so that a random model's answer ends (its strings would
# otherwise run on, each character as likely as the closing quote)
BOUNDED = json.loads(json.dumps(SCHEMA)
                     .replace('"type": "string"', '"type": "string", "maxLength": 12')
                     .replace('"type": "integer"', '"type": "integer", "minimum": 0, "maximum": 999')
                     .replace('"type": "number"', '"type": "integer", "minimum": 0, "maximum": 999')
                     .replace('"type": "array"', '"type": "array", "maxItems": 3'))
EOS = 0  # <|endoftext|>
SLOW = 20.0


def train_tokenizer(vocab: int, folder: Path) -> Path:
    """A byte-level BPE of `vocab` tokens on the standard library's .py files (1500 files, a few MB of text;
    a vocabulary under 4000: 100 files)."""
    from tokenizers import ByteLevelBPETokenizer

    path = folder / f"bpe{vocab}.json"
    if path.is_file():
        return path
    files = sorted(Path(os.__file__).parent.glob("**/*.py"))[:1500 if vocab >= 4000 else 100]
    texts = (f.read_text(encoding="utf-8", errors="ignore") for f in files)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab, min_frequency=2, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    bpe.save(str(path))
    return path


# -- part 1: the engines -----------------------------------------------------------------------------------
def walk_llguidance(table, grammar: str, ids: list[int]) -> tuple[float, list[float]]:
    import llguidance

    t0 = time.perf_counter()
    m = llguidance.LLMatcher(table, grammar, log_level=0)
    mask = m.compute_bitmask()
    compile_s = time.perf_counter() - t0
    steps = []
    for i, t in enumerate(ids):
        t0 = time.perf_counter()
        if i:
            mask = m.compute_bitmask()
        assert mask[t // 8] >> (t % 8) & 1, f"llguidance refused token {i}"
        assert m.consume_token(t), m.get_error()
        steps.append(time.perf_counter() - t0)
    return compile_s, steps


def walk_outlines(vocabulary, regex: str, ids: list[int]) -> tuple[float, list[float]]:
    import outlines_core

    t0 = time.perf_counter()
    guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
    mask = torch.zeros((vocabulary_size(vocabulary) + 31) // 32, dtype=torch.int32)
    guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
    compile_s = time.perf_counter() - t0
    steps = []
    for i, t in enumerate(ids):
        t0 = time.perf_counter()
        if i:
            guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
        assert int(mask[t // 32]) >> (t % 32) & 1, f"outlines-core refused token {i}"
        guide.advance(t)
        steps.append(time.perf_counter() - t0)
    return compile_s, steps


def vocabulary_size(vocabulary) -> int:
    return vocabulary.__len__() + 1


def walk_xgrammar(compile_fn, n_vocab: int, ids: list[int]) -> tuple[float, list[float]]:
    import xgrammar

    t0 = time.perf_counter()
    matcher = xgrammar.GrammarMatcher(compile_fn())
    mask = xgrammar.allocate_token_bitmask(1, n_vocab)
    matcher.fill_next_token_bitmask(mask)
    compile_s = time.perf_counter() - t0
    steps = []
    for i, t in enumerate(ids):
        t0 = time.perf_counter()
        if i:
            matcher.fill_next_token_bitmask(mask)
        assert int(mask[0, t // 32]) >> (t % 32) & 1, f"xgrammar refused token {i}"
        assert matcher.accept_token(t)
        steps.append(time.perf_counter() - t0)
    return compile_s, steps


def engines(tok_path: Path, repeats: int, names: list[str]) -> list[dict]:
    """Each engine x grammar: compile ms (median) and per-token µs (median over tokens and rounds)."""
    import llguidance
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    V = tok.get_vocab_size()
    table = llguidance.LLTokenizer(tok.to_str(), n_vocab=V, eos_token=EOS)
    tight = json.dumps(ANSWER, separators=(",", ":"))  # every engine's compact form
    grammars = {"schema": SCHEMA, "json_object": {"type": "object"}}
    walkers = {}
    from qkv.generate.grammar import json_schema_grammar

    walkers["llguidance"] = {g: (lambda s=s: walk_llguidance(table, json_schema_grammar(s),
                                                             tok.encode(tight).ids))
                             for g, s in grammars.items()}
    try:
        if "outlines-core" not in names:
            raise ImportError
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        pieces: dict[bytes, list[int]] = {}
        for i in range(1, V):
            pieces.setdefault(table.decode_bytes([i]), []).append(i)
        vocabulary = outlines_core.Vocabulary(EOS, pieces)
        regexes = {g: build_regex_from_schema(json.dumps(s), r"[ ]?") for g, s in grammars.items()}
        walkers["outlines-core"] = {g: (lambda r=r: walk_outlines(vocabulary, r, tok.encode(tight).ids))
                                    for g, r in regexes.items()}
    except ImportError:
        print("outlines-core left out (not installed, or not in --engines)", file=sys.stderr)
    try:
        if "xgrammar" not in names:
            raise ImportError
        import xgrammar

        info = xgrammar.TokenizerInfo([table.decode_bytes([i]) for i in range(V)],
                                      vocab_type=xgrammar.VocabType.RAW, vocab_size=V, stop_token_ids=[EOS])
        compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        walkers["xgrammar"] = {
            "schema": lambda: walk_xgrammar(lambda: compiler.compile_json_schema(
                json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")), V,
                tok.encode(tight).ids),
            "json_object": lambda: walk_xgrammar(lambda: compiler.compile_json_schema(
                json.dumps({"type": "object"}), any_whitespace=False, separators=(",", ":")), V,
                tok.encode(tight).ids)}
    except ImportError:
        print("xgrammar left out (not installed: see --xgrammar-path; or not in --engines)", file=sys.stderr)
    rows = []
    for g in grammars:
        fns = {name: w[g] for name, w in walkers.items()}
        _, first = interleaved(fns, 1)  # warm-up round (first calls allocate)
        # an engine that takes over SLOW seconds to compile is timed by that round alone (outlines-core's
        # index of the generic JSON object regex takes minutes at a 32k vocabulary)
        slow = {k for k, (c, _) in first.items() if c > SLOW}
        compile_s = {k: [first[k][0]] if k in slow else [] for k in fns}
        steps: dict[str, list[float]] = {k: list(first[k][1]) if k in slow else [] for k in fns}
        for _ in range(repeats):
            _, res = interleaved({k: f for k, f in fns.items() if k not in slow}, 1)
            for k, (c, s) in res.items():
                compile_s[k].append(c)
                steps[k].extend(s)
        for k in fns:
            rows.append({"grammar": g, "engine": k, "vocab": V, "tokens": len(first[k][1]),
                         "compile_ms": 1e3 * statistics.median(compile_s[k]),
                         "per_token_us": 1e6 * statistics.median(steps[k]),
                         "per_token_p90_us": 1e6 * sorted(steps[k])[int(0.9 * len(steps[k]))]})
    return rows


# -- part 2: qkv's engine ----------------------------------------------------------------------------------
def model_folder(tok_path: Path, folder: Path, quick: bool) -> Path:
    import shutil

    import transformers

    path = folder / "gpt2"
    path.mkdir(exist_ok=True)
    shutil.copy(tok_path, path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    from tokenizers import Tokenizer

    V = Tokenizer.from_file(str(tok_path)).get_vocab_size()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=1024, n_embd=64 if quick else 256,
                                  n_layer=2 if quick else 4, n_head=4, eos_token_id=EOS, bos_token_id=EOS,
                                  initializer_range=0.5)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(path)
    return path


def time_in_mask(run) -> float:
    """Seconds spent inside GrammarMask (matcher, bitmask, masked_fill) during one run."""
    from qkv.generate.processors import GrammarMask

    spent = [0.0]
    call = GrammarMask.__call__

    def timed(self, ids, scores):
        t0 = time.perf_counter()
        out = call(self, ids, scores)
        spent[0] += time.perf_counter() - t0
        return out

    GrammarMask.__call__ = timed
    try:
        run()
    finally:
        GrammarMask.__call__ = call
    return spent[0]


def engine_overhead(path: Path, batch: int, repeats: int) -> dict:
    """Greedy requests under the schema's grammar vs the same requests free for the same lengths."""
    from qkv.generate import Engine
    from qkv.generate.grammar import json_schema_grammar
    from qkv.serve import load_served

    served = load_served(path)
    grammar = json_schema_grammar(BOUNDED)
    prompts = [served.codec.encode(f"Order number {i}: ") for i in range(batch)]

    def run(constrained: bool, lengths: list[int] | None = None) -> list[list[int]]:
        engine = Engine(served.model, tokenizer=served.codec, block_size=16, num_blocks=2048,
                        eos_token_id=EOS)
        if constrained:
            rids = [engine.add_request(p, max_new_tokens=300, grammar=grammar) for p in prompts]
        else:
            rids = [engine.add_request(p, max_new_tokens=n, eos_token_id=[])
                    for p, n in zip(prompts, lengths)]
        out = engine.run()
        return [out[r] for r in rids]

    with torch.inference_mode():
        constrained = run(True)
        lengths = [len(o) for o in constrained]
        for o in constrained:  # every answer parses and is whole
            assert o[-1] == EOS, "an answer did not end within 300 tokens"
            json.loads(served.codec.decode(o[:-1]))
        times, last = interleaved({"grammar": lambda: run(True), "free": lambda: run(False, lengths)},
                                  repeats)
        mask_s = time_in_mask(lambda: run(True))
    assert [len(o) for o in last["free"]] == lengths
    n = sum(lengths)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"requests": batch, "tokens": n, "grammar_s": med["grammar"], "free_s": med["free"],
            "in_mask_per_token_us": 1e6 * mask_s / n,
            "grammar_tok_s": n / med["grammar"], "free_tok_s": n / med["free"],
            "overhead_per_token_us": 1e6 * (med["grammar"] - med["free"]) / n,
            "slowdown": med["grammar"] / med["free"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a 1000-token vocabulary, a tiny model, one round")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--engines", nargs="+", default=["llguidance", "outlines-core", "xgrammar"],
                    help="the grammar engines of part 1 (llguidance always runs)")
    ap.add_argument("--xgrammar-path", default=None, help="a folder xgrammar is installed in (--target)")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args()
    if a.xgrammar_path:
        sys.path.append(a.xgrammar_path)
    vocab, repeats = (1000, 1) if a.quick else (a.vocab, a.repeats)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    cache = Path(tempfile.gettempdir()) / "qkv-bench-structured"
    cache.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    tok_path = train_tokenizer(vocab, cache)
    print(f"tokenizer: {vocab} tokens ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    rows = engines(tok_path, repeats, a.engines)
    with tempfile.TemporaryDirectory() as tmp:
        e2e = engine_overhead(model_folder(tok_path, Path(tmp), a.quick), 2 if a.quick else a.batch, repeats)
    lines = [f"## Grammar engines: {vocab}-token byte-level BPE, CPU ({torch.get_num_threads()} threads)", "",
             "| grammar | engine | tokens walked | compile + first mask (ms) | per token, median (µs) | "
             "p90 (µs) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['grammar']} | {r['engine']} | {r['tokens']} | {r['compile_ms']:.1f} | "
                     f"{r['per_token_us']:.0f} | {r['per_token_p90_us']:.0f} |")
    lines += ["", f"## qkv Engine, greedy, {e2e['requests']} requests, {e2e['tokens']} tokens", "",
              "| | tok/s | seconds |", "|---|---|---|",
              f"| unconstrained | {e2e['free_tok_s']:.0f} | {e2e['free_s']:.3f} |",
              f"| JSON schema (GrammarMask) | {e2e['grammar_tok_s']:.0f} | {e2e['grammar_s']:.3f} |",
              "", f"constrained minus unconstrained: {e2e['overhead_per_token_us']:.0f} µs per token "
              f"({e2e['slowdown']:.2f}x the unconstrained time), of which inside GrammarMask "
              f"{e2e['in_mask_per_token_us']:.0f} µs"]
    write_results(a.out, "structured" + ("_quick" if a.quick else ""), {"engines": rows, "engine": e2e,
                                                                       "vocab": vocab}, lines)


if __name__ == "__main__":
    main()
