"""The streaming path's parts: incremental detokenization (StreamDecoder) against a full decode, the engine
worker's batched delivery (one hand-over per engine step, every request's items in order), and SSE events
byte-equal to json.dumps of their payload."""

from __future__ import annotations

import asyncio
import json
import pydoc_data.topics
import random

import httpx
import pytest
from _servehelpers import running_server

from qkv.generate import Engine
from qkv.generate.text import StreamDecoder, cut_at_stop
from qkv.serve import load_served
from qkv.serve import worker as worker_mod
from qkv.serve.worker import EngineWorker

SPECIALS = ["<|endoftext|>", "<|end|>"]
TEXT = ("Grüße aus Köln — naïve café, 東京タワー and emoji 🙂🚀 mixed with plain ASCII words. " * 3)


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE (the GPT-2 kind) trained here on stdlib text plus multi-byte characters: its base
    alphabet is the 256 bytes, so random ids split characters across tokens and make invalid UTF-8."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(pydoc_data.topics.topics.values())[:30] + [TEXT] * 5, trainer)
    return tok


def _metaspace():
    """A SentencePiece-like decoder (Metaspace: '▁' is a space, dropped at the very start)."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {w: i for i, w in enumerate(["<unk>", "▁the", "▁ca", "t", "s", "▁", "é", "▁naïve", ",", "."])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    return tok


def _wordpiece():
    """benchmarks/serve.py's Llama tokenizer: words joined by single spaces."""
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(50)}, unk_token="t0"))
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return tok


def _stream(decode, ids, stop):
    ts = StreamDecoder(decode, stop)
    pieces = [ts.push(t) for t in ids] + [ts.flush()]
    return pieces, ts


def _check(decode, vocab: int, seed: int, n_seqs: int = 60):
    rng = random.Random(seed)
    for k in range(n_seqs):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        full = decode(ids)
        stop = []
        if k % 2 and len(full) > 3:  # a stop string taken from the text (it may occur earlier too)
            a = rng.randrange(len(full) - 2)
            stop = [full[a:a + rng.randrange(1, 4)]]
        pieces, ts = _stream(decode, ids, stop)
        assert "".join(pieces) == cut_at_stop(full, stop), (ids, stop)
        assert not ts.mismatch


def test_incremental_text_equals_the_full_decode_byte_level_bpe(bpe):
    decode = lambda ids: bpe.decode(ids, skip_special_tokens=True)  # noqa: E731  (TextCodec's call)
    _check(decode, bpe.get_vocab_size(), 0, 300)
    # the split of a multi-byte character over tokens: its bytes one token each
    ids = [bpe.token_to_id(c) for c in pre_tokens("é🙂東")]
    pieces, _ = _stream(decode, ids, [])
    assert "".join(pieces) == "é🙂東" and "\ufffd" not in "".join(pieces)
    assert pieces[0] == "" and pieces[1] == "é"  # nothing sent while the character is incomplete
    # incremental: every token decodes a short window, only the end decodes all ids (once)
    sizes = []
    ids = [bpe.token_to_id(c) for c in pre_tokens(TEXT[:120])]
    pieces, _ = _stream(lambda x: (sizes.append(len(x)), decode(x))[1], ids, ["@@"])
    # (a 4-byte character: 4 tokens)
    assert "".join(pieces) == decode(ids) and sizes[-1] == len(ids) and max(sizes[:-1]) <= 10


def pre_tokens(text: str) -> list[str]:
    """text as byte-level tokens, one per byte (the ByteLevel alphabet)."""
    from tokenizers import pre_tokenizers

    return [c for w, _ in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text) for c in w]


def test_incremental_text_equals_the_full_decode_other_decoders():
    for i, tok in enumerate((_metaspace(), _wordpiece())):
        _check(lambda ids, tok=tok: tok.decode(ids), tok.get_vocab_size(), i + 1)
    from qkv.tasks import build_task

    chars = build_task("charlm", family="gpt", context=32).tokenizer  # qkv's own (specials skipped)
    _check(chars.decode, chars.vocab_size, 5)


def test_a_stop_string_split_over_tokens_is_held_back_and_left_out(bpe):
    decode = lambda ids: bpe.decode(ids, skip_special_tokens=True)  # noqa: E731
    ids = [bpe.token_to_id(c) for c in pre_tokens("ab🙂cd")]
    pieces, ts = _stream(decode, ids, ["🙂c"])
    assert "".join(pieces) == "ab" and ts.stopped


def test_worker_hands_over_one_batch_per_step_in_order(run_folder, monkeypatch):
    """Every request's items arrive in order (its tokens = Engine.run() alone's, then one 'done'), and the
    event loop is called once per engine step, not once per token."""
    served = load_served(run_folder)
    prompts = [served.codec.encode(p) for p in ("ROMEO: ", "a", "To be, or not", "xy")]
    news = [9, 14, 5, 11]
    ref = Engine(served.model, block_size=4)
    rids = [ref.add_request(p, n) for p, n in zip(prompts, news)]
    out = ref.run()
    calls = []
    real = worker_mod.deliver
    monkeypatch.setattr(worker_mod, "deliver", lambda batch: (calls.append(len(batch)), real(batch)))
    engine = Engine(served.model, block_size=4)
    w = EngineWorker(engine)
    w.start()

    async def one(p, n):
        t = w.submit(p, {"max_new_tokens": n})
        got = []
        while not got or got[-1][0] != "done":
            while not t.items:
                t.waiter = asyncio.get_running_loop().create_future()
                await t.waiter
            got += t.items
            t.items = []
        return got

    async def main():
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, news)))

    try:
        got = asyncio.run(main())
    finally:
        w.stop()
    for g, r in zip(got, rids):
        assert g == [("token", (0, x, None)) for x in out[r]] + [("done", "length")]
    assert sum(calls) == sum(news) + len(news)
    assert len(calls) <= engine.stats()["steps"] < sum(news)


def test_sse_events_are_json_dumps_of_their_payload(gpt2_folder):
    """The per-token events are made from a template: byte for byte what json.dumps writes, for completions
    and chat, with the random model's arbitrary (often non-ASCII) text."""
    served = load_served(gpt2_folder)
    with running_server(gpt2_folder, block_size=4) as (url, _):
        for path, body in (("/v1/completions", {"prompt": "The class"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
            body = {
                **body,
                "model": served.name,
                "max_tokens": 24,
                "temperature": 1.0,
                "seed": 3,
                "stream": True,
            }
            with httpx.stream("POST", url + path, json=body, timeout=60) as r:
                lines = [x for x in r.iter_lines() if x.startswith("data: {")]
            assert len(lines) >= 2
            for line in lines:
                assert line == "data: " + json.dumps(json.loads(line[6:]))
            choices = [json.loads(x[6:])["choices"][0] for x in lines]
            texts = [c["text"] if "text" in c else c["delta"].get("content") for c in choices]
            assert any(texts)
