"""GenerationConfig and the logits processors.

- every option given through a GenerationConfig equals the same option given as a keyword;
- greedy / sampling with every processor equals an independent reference: a plain loop that recomputes the
  full forward pass each step and applies Hugging Face's LogitsProcessor classes (transformers) to the same
  logits, then argmax or torch.multinomial with the same generator;
- each processor alone equals its Hugging Face counterpart on random logits;
- beam search honours the processors (no repeated n-gram, min length, forced eos);
- generation_config.json (Hugging Face's own writer) is read with its field names; unknown keys are errors
  (qkv's strict loader) or named warnings (an HF file);
- the Engine serves requests with different settings in one batch, each as generate() alone.
"""

from __future__ import annotations

import json

import pytest
import torch
from _genmodels import tiny_encdec, tiny_gpt
from transformers.generation import logits_process as hf

import qkv
from qkv.config import ConfigError
from qkv.generate import Engine, GenerationConfig, generate
from qkv.generate.processors import (
    Context,
    ForcedBOS,
    ForcedEOS,
    MinNewTokens,
    MinP,
    NoRepeatNGram,
    Pipeline,
    RepetitionPenalty,
)

# every option, alone or in the combinations that need each other; decoder-only GPT
OPTIONS = [
    dict(max_new_tokens=7), dict(max_length=9), dict(do_sample=True, seed=3),
    dict(do_sample=True, temperature=0.6, seed=1),
    dict(do_sample=True, top_k=3, seed=2), dict(do_sample=True, top_p=0.8, seed=4),
    dict(do_sample=True, min_p=0.2, seed=5),
    dict(do_sample=True, temperature=0.0), dict(repetition_penalty=1.8), dict(repetition_penalty=0.7),
    dict(no_repeat_ngram_size=2), dict(min_new_tokens=6, eos_token_id=4), dict(min_length=8, eos_token_id=4),
    dict(eos_token_id=4), dict(eos_token_id=[4, 7], pad_token_id=10), dict(forced_eos_token_id=9),
    dict(forced_bos_token_id=2), dict(num_beams=3), dict(num_beams=3, length_penalty=0.0, eos_token_id=4),
    dict(num_beams=3, num_return_sequences=2), dict(num_beams=3, early_stopping=True, eos_token_id=4),
    dict(num_beams=3, early_stopping=False, eos_token_id=4),
    dict(do_sample=True, num_return_sequences=2, seed=7),
    dict(use_cache=False), dict(max_new_tokens=20, context_overflow="slide"),
    dict(do_sample=True, temperature=1.4, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
         no_repeat_ngram_size=3, seed=9),
]


@pytest.mark.parametrize("kw", OPTIONS, ids=[",".join(k) for k in OPTIONS])
def test_every_option_through_the_config_equals_the_keyword(kw):
    m = tiny_gpt("learned", context=16)
    x = torch.randint(0, 11, (2, 3), generator=torch.Generator().manual_seed(0))
    by_keyword = generate(m, x, **({"max_new_tokens": 10} | kw))
    by_config = generate(m, x, GenerationConfig(**({"max_new_tokens": 10} | kw)))
    assert torch.equal(by_config, by_keyword)
    # a config plus keyword overrides: the keyword wins
    assert torch.equal(generate(m, x, GenerationConfig(max_new_tokens=2), **({"max_new_tokens": 10} | kw)),
                       by_keyword)


def test_stop_strings_and_seq2seq_options_through_the_config():
    m = tiny_gpt("rope")
    x = torch.tensor([[1, 2, 3]])
    decode = lambda ids: "".join(chr(ord("a") + i) for i in ids)  # noqa: E731
    free = decode(generate(m, x, 12)[0, 3:].tolist())
    kw = dict(stop_strings=[free[4:6]], max_new_tokens=12)
    assert torch.equal(generate(m, x, GenerationConfig(**kw), tokenizer=decode),
                       generate(m, x, tokenizer=decode, **kw))
    e = tiny_encdec()
    src = torch.randint(3, 11, (2, 5))
    for kw in (dict(decoder_start_token_id=5), dict(bos_token_id=6),
               dict(forced_bos_token_id=8, num_beams=2)):
        assert torch.equal(generate(e, src, GenerationConfig(max_new_tokens=6, **kw)),
                           generate(e, src, 6, **kw))
    assert int(generate(e, src, 6, forced_bos_token_id=8)[0, 0]) == 8


# -- an independent reference: full recompute + Hugging Face's processors ---------------------------------
def reference(model, ids, n, processors, warpers=(), *, seed=None, eos=None, pad=0, seq2seq_src=None,
              start=1):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    seq = ids.clone() if seq2seq_src is None else torch.full((seq2seq_src.shape[0], 1), start)
    done = torch.zeros(seq.shape[0], dtype=torch.bool)
    for _ in range(n):
        with torch.no_grad():
            if seq2seq_src is None:
                logits = model(seq).logits[:, -1].float()
            else:
                logits = model(seq2seq_src, decoder_input_ids=seq).logits[:, -1].float()
        for p in processors:
            logits = p(seq, logits)
        if warpers:
            for w in warpers:
                logits = w(seq, logits)
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        nxt = nxt.masked_fill(done, pad)
        seq = torch.cat([seq, nxt[:, None]], 1)
        if eos is not None:
            done |= torch.isin(nxt, torch.tensor(eos))
            if bool(done.all()):
                break
    return seq if seq2seq_src is None else seq[:, 1:]


def test_greedy_and_sampling_equal_hugging_face_processors():
    m = tiny_gpt("alibi", gqa=True)
    x = torch.randint(0, 11, (3, 4), generator=torch.Generator().manual_seed(1))
    T, N = 4, 10
    cases = [
        (dict(), [], []),
        (dict(do_sample=True, temperature=0.7, top_k=5, top_p=0.85, seed=3), [],
         [hf.TemperatureLogitsWarper(0.7), hf.TopKLogitsWarper(5), hf.TopPLogitsWarper(0.85)]),
        (dict(do_sample=True, temperature=1.5, min_p=0.1, seed=4), [],
         [hf.TemperatureLogitsWarper(1.5), hf.MinPLogitsWarper(0.1)]),
        (dict(repetition_penalty=2.0), [hf.RepetitionPenaltyLogitsProcessor(2.0)], []),
        (dict(no_repeat_ngram_size=2), [hf.NoRepeatNGramLogitsProcessor(2)], []),
        (dict(min_new_tokens=7, eos_token_id=3), [hf.MinNewTokensLengthLogitsProcessor(T, 7, 3)], []),
        (dict(min_length=9, eos_token_id=3), [hf.MinLengthLogitsProcessor(9, 3)], []),
        (dict(forced_eos_token_id=6), [hf.ForcedEOSTokenLogitsProcessor(T + N, 6)], []),
        (dict(do_sample=True, repetition_penalty=1.5, no_repeat_ngram_size=3, temperature=1.2, top_k=8,
              seed=5),
         [hf.RepetitionPenaltyLogitsProcessor(1.5), hf.NoRepeatNGramLogitsProcessor(3)],
         [hf.TemperatureLogitsWarper(1.2), hf.TopKLogitsWarper(8)]),
    ]
    for kw, procs, warps in cases:
        eos = kw.get("eos_token_id")
        ref = reference(m, x, N, procs, warps, seed=kw.get("seed"), eos=None if eos is None else [eos],
                        pad=eos or 0)
        got = generate(m, x, N, **kw)
        assert torch.equal(got, ref), kw


def test_forced_bos_equals_hugging_face_on_an_encoder_decoder():
    e = tiny_encdec()
    src = torch.randint(3, 11, (2, 5))
    ref = reference(e, None, 6, [hf.ForcedBOSTokenLogitsProcessor(7)], seq2seq_src=src, eos=[2], pad=0)
    assert torch.equal(generate(e, src, 6, forced_bos_token_id=7), ref)


def test_repetition_penalty_ignores_left_padding_like_hugging_face():
    m = tiny_gpt("rope")
    ids = torch.tensor([[0, 0, 5, 6], [1, 2, 3, 4]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    got = generate(m, ids, 6, attention_mask=mask, repetition_penalty=3.0)
    for b in range(2):  # each row alone, without padding, through HF's processor
        row = ids[b:b + 1, int((mask[b] == 0).sum()):]
        ref = reference(m, row, 6, [hf.RepetitionPenaltyLogitsProcessor(3.0)])
        assert got[b, -6:].tolist() == ref[0, -6:].tolist()


# -- each processor against Hugging Face's, on the same logits ---------------------------------------------
def test_each_processor_equals_hugging_face():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 20, generator=g) * 3
    ids = torch.randint(0, 20, (4, 9), generator=g)
    ids[0, 6:] = ids[0, :3]  # a repeated trigram prefix, so no-repeat has something to ban
    pairs = [
        (RepetitionPenalty(1.7), hf.RepetitionPenaltyLogitsProcessor(1.7)),
        (RepetitionPenalty(0.6), hf.RepetitionPenaltyLogitsProcessor(0.6)),
        (RepetitionPenalty(2.0, torch.tensor([0, 3, 1, 8])),
         hf.RepetitionPenaltyLogitsProcessor(2.0, prompt_ignore_length=torch.tensor([0, 3, 1, 8]))),
        (NoRepeatNGram(1), hf.NoRepeatNGramLogitsProcessor(1)),
        (NoRepeatNGram(2), hf.NoRepeatNGramLogitsProcessor(2)),
        (NoRepeatNGram(3), hf.NoRepeatNGramLogitsProcessor(3)),
        (NoRepeatNGram(12), hf.NoRepeatNGramLogitsProcessor(12)),
        (MinP(0.05), hf.MinPLogitsWarper(0.05)),
        (MinP(0.5), hf.MinPLogitsWarper(0.5)),
        (MinP(1.0), hf.MinPLogitsWarper(1.0)),
        (MinNewTokens(5, 5, [3, 4]), hf.MinNewTokensLengthLogitsProcessor(5, 5, [3, 4])),
        (MinNewTokens(3, 5, [3]), hf.MinNewTokensLengthLogitsProcessor(3, 5, [3])),
        (ForcedEOS(10, [2]), hf.ForcedEOSTokenLogitsProcessor(10, 2)),
        (ForcedEOS(10, [2, 5]), hf.ForcedEOSTokenLogitsProcessor(10, [2, 5])),
        (ForcedEOS(12, [2]), hf.ForcedEOSTokenLogitsProcessor(12, 2)),
    ]
    for ours, theirs in pairs:
        got, want = ours(ids, scores.clone()), theirs(ids, scores.clone())
        torch.testing.assert_close(got, want, msg=type(ours).__name__)
    assert torch.isinf(NoRepeatNGram(3)(ids, scores)).any()  # the case is not vacuous
    # forced BOS: Hugging Face forces it at decoder length 1 (an encoder-decoder's first step)
    one = ids[:, :1]
    torch.testing.assert_close(ForcedBOS(7, 1)(one, scores.clone()),
                               hf.ForcedBOSTokenLogitsProcessor(7)(one, scores.clone()))
    torch.testing.assert_close(ForcedBOS(7, 1)(ids, scores.clone()), scores)


# -- beam search with processors ---------------------------------------------------------------------------
def test_beam_search_honours_the_processors():
    m = tiny_gpt("learned", vocab=6, init_std=0.8)
    x = torch.tensor([[0, 2, 1], [3, 3, 4]])
    out = generate(m, x, 12, num_beams=4, num_return_sequences=4, no_repeat_ngram_size=2, eos_token_id=None)
    for row in out.tolist():
        grams = [tuple(row[i:i + 2]) for i in range(len(row) - 1)]
        assert len(grams) == len(set(grams)), row
    free = generate(m, x, 8, num_beams=3, eos_token_id=5, pad_token_id=0, return_dict=True)
    longer = generate(m, x, 8, num_beams=3, eos_token_id=5, pad_token_id=0, min_new_tokens=6)
    for row in longer[:, 3:].tolist():
        assert 5 not in row[:5]
    forced = generate(m, x, 5, num_beams=3, forced_eos_token_id=4, eos_token_id=4)
    assert all(4 in row for row in forced[:, 3:].tolist())
    assert free.sequences.shape[0] == 2


@pytest.mark.parametrize("early", [True, False, "never"])
def test_beam_early_stopping_modes_keep_their_promise(early):
    """True stops at num_beams finished hypotheses (so it never scores better than 'never'); 'never' is
    the exact bound (it equals an exhaustive search, tests/generate/test_search.py)."""
    m = tiny_gpt("learned", vocab=5, init_std=0.8)
    x = torch.tensor([[0, 2, 1]])
    exact = generate(m, x, 5, num_beams=6, eos_token_id=3, return_dict=True)
    got = generate(m, x, 5, num_beams=6, eos_token_id=3, early_stopping=early, return_dict=True)
    assert float(got.scores[0]) <= float(exact.scores[0]) + 1e-6
    if early == "never":
        assert torch.equal(got.sequences, exact.sequences)


# -- reading configs ---------------------------------------------------------------------------------------
def test_hugging_face_generation_config_json_is_read_by_field_name(tmp_path):
    from transformers import GenerationConfig as HFGenerationConfig

    HFGenerationConfig(max_new_tokens=40, min_new_tokens=2, do_sample=True, temperature=0.7, top_k=30,
                       top_p=0.95,
                       min_p=0.02, repetition_penalty=1.1, no_repeat_ngram_size=3, eos_token_id=[2, 7],
                       pad_token_id=0, bos_token_id=1, decoder_start_token_id=1, forced_bos_token_id=5,
                       forced_eos_token_id=2, stop_strings=["\n\n"]).save_pretrained(tmp_path)
    cfg = GenerationConfig.from_model_folder(tmp_path)
    assert (cfg.max_new_tokens, cfg.min_new_tokens, cfg.do_sample, cfg.temperature, cfg.top_k, cfg.top_p) == \
        (40, 2, True, 0.7, 30, 0.95)
    assert (cfg.min_p, cfg.repetition_penalty, cfg.no_repeat_ngram_size) == (0.02, 1.1, 3)
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id, cfg.decoder_start_token_id) == ([2, 7], 0,
                                                                                                  1, 1)
    assert (cfg.forced_bos_token_id, cfg.forced_eos_token_id, cfg.stop_strings) == (5, 2, ["\n\n"])
    beams = tmp_path / "beams"
    HFGenerationConfig(max_length=30, min_length=3, num_beams=4, num_return_sequences=2, length_penalty=0.8,
                       early_stopping=True, eos_token_id=2).save_pretrained(beams)
    b = GenerationConfig.from_model_folder(beams)
    assert (b.max_length, b.min_length, b.num_beams, b.num_return_sequences, b.length_penalty,
            b.early_stopping) == \
        (30, 3, 4, 2, 0.8, True)
    assert (b.new_tokens(5), b.min_tokens(2)) == (25, 1)  # HF's lengths count the prompt
    assert GenerationConfig.from_file(tmp_path / "generation_config.json") == cfg
    # an option qkv does not implement is named, not silently applied or dropped
    (tmp_path / "generation_config.json").write_text(json.dumps({"typical_p": 0.5,
                                                                 "transformers_version": "5"}))
    with pytest.warns(UserWarning, match="typical_p"):
        GenerationConfig.from_model_folder(tmp_path)


def test_qkv_config_is_strict_and_validated(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'temperature'"):
        GenerationConfig.from_dict({"temprature": 0.5})
    with pytest.raises(ConfigError, match="expected an integer"):
        GenerationConfig.from_dict({"top_k": "many"})
    for bad in (dict(top_p=0.0), dict(min_p=1.5), dict(repetition_penalty=0.0), dict(no_repeat_ngram_size=-1),
                dict(early_stopping="sometimes"), dict(max_new_tokens=-1), dict(num_beams=0)):
        with pytest.raises(ConfigError):
            GenerationConfig(**bad)
    with pytest.raises(ConfigError, match="did you mean 'top_p'"):
        generate(tiny_gpt(), torch.tensor([[1]]), 2, top_pp=0.5)
    (tmp_path / "g.yaml").write_text("max_new_tokens: 5\ndo_sample: true\nseed: 3\n")
    assert GenerationConfig.from_file(tmp_path / "g.yaml") == GenerationConfig(max_new_tokens=5,
                                                                               do_sample=True, seed=3)


def test_a_model_folder_brings_its_generation_defaults(tmp_path):
    m = tiny_gpt("rope")
    x = torch.tensor([[1, 2, 3]])
    free = generate(m, x, 8)[0, 3:].tolist()
    first = {t: free.index(t) for t in reversed(free)}  # token -> where it first appears
    (a, ia), (b, ib) = sorted(first.items(), key=lambda kv: kv[1])[:2]
    m.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": b, "pad_token_id": 10}))
    loaded = qkv.from_pretrained(tmp_path)
    assert loaded.generate(x, 8)[0, 3:].tolist() == free[:ib + 1]  # stopped at the folder's eos
    assert loaded.generate(x, 8, eos_token_id=a)[0, 3:].tolist() == free[:ia + 1]  # a keyword wins


# -- the engine: per-request settings in one batch -----------------------------------------------------------
def test_engine_requests_with_their_own_settings():
    m = tiny_gpt("rope", gqa=True)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 1]]
    settings = [GenerationConfig(max_new_tokens=6),
                GenerationConfig(max_new_tokens=5, repetition_penalty=2.0),
                GenerationConfig(max_new_tokens=7, no_repeat_ngram_size=2, eos_token_id=3),
                GenerationConfig(max_new_tokens=6, min_new_tokens=4,
                                 eos_token_id=int(generate(m, torch.tensor([[10, 1]]), 2)[0, -1]))]
    engine = Engine(m, block_size=4, max_batch_size=4)
    ids = [engine.add_request(p, s) for p, s in zip(prompts, settings)]
    out = engine.run()
    for rid, p, s in zip(ids, prompts, settings):
        ref = generate(m, torch.tensor([p]), s)[0, len(p):].tolist()
        pad = s.pad_token_id if s.pad_token_id is not None else (s.eos_ids[0] if s.eos_ids else 0)
        if s.eos_ids and s.eos_ids[0] in ref:  # generate pads a stopped row; the engine just stops
            ref = ref[: ref.index(s.eos_ids[0]) + 1]
        assert out[rid] == ref, (s, pad)
    # sampling settings per request, each with its own seed: as generate() with that seed
    e = Engine(m)
    a = e.add_request([1, 2], GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.3, seed=5))
    b = e.add_request([3, 4, 5], GenerationConfig(max_new_tokens=6, do_sample=True, top_k=4, seed=6))
    got = e.run()
    assert got[a] == generate(m, torch.tensor([[1, 2]]), 6, do_sample=True, temperature=1.3,
                              seed=5)[0, 2:].tolist()
    assert got[b] == generate(m, torch.tensor([[3, 4, 5]]), 6, do_sample=True, top_k=4,
                              seed=6)[0, 3:].tolist()
    with pytest.raises(ValueError, match="num_beams"):
        e.add_request([1], num_beams=2)


def test_in_place_processors_and_no_repeat_lengths_equal_hugging_face():
    """apply_ (beam search's in-place path) computes what __call__ and HF compute; NoRepeatNGram from no
    complete n-gram (length < n) to many repeats (a vocabulary of 3, so most n-grams recur)."""
    g = torch.Generator().manual_seed(1)
    hits = 0
    for length in (0, 1, 2, 3, 4, 7, 15):
        ids = torch.randint(0, 3, (5, length), generator=g)
        scores = torch.randn(5, 6, generator=g)
        for n in (1, 2, 3, 4):
            want = hf.NoRepeatNGramLogitsProcessor(n)(ids, scores.clone())
            torch.testing.assert_close(NoRepeatNGram(n)(ids, scores.clone()), want)
            buf = scores.clone()
            torch.testing.assert_close(NoRepeatNGram(n).apply_(ids, buf), want)
            torch.testing.assert_close(buf, want)  # written in place
            hits += int(torch.isinf(want).any())
    assert hits >= 10  # not vacuous: most (length, n) cases ban something
    ids = torch.randint(0, 20, (4, 3), generator=g)
    scores = torch.randn(4, 20, generator=g)
    buf = scores.clone()
    MinNewTokens(0, 5, [3, 4]).apply_(ids, buf)
    torch.testing.assert_close(buf, hf.MinNewTokensLengthLogitsProcessor(0, 5, [3, 4])(ids, scores.clone()))


def test_forces_is_true_exactly_where_the_output_ignores_the_scores():
    """Pipeline.forces(cur): at that length the processed scores are the same whatever the logits (beam search
    then skips its last forward); elsewhere they depend on them."""
    g = torch.Generator().manual_seed(2)
    for proc in (ForcedEOS(10, [2]), ForcedEOS(10, [2, 5]), ForcedBOS(7, 9)):
        for cur in range(7, 12):
            ids = torch.randint(0, 20, (3, cur), generator=g)
            a, b = torch.randn(3, 20, generator=g), torch.randn(3, 20, generator=g)
            assert proc.forces(cur) == torch.equal(proc(ids, a), proc(ids, b)), cur
    cfg = GenerationConfig(forced_eos_token_id=2, max_new_tokens=5)
    pipe = Pipeline(cfg, Context(prompt_len=1, max_new_tokens=5, eos_ids=[2]))
    assert [pipe.forces(cur) for cur in range(1, 7)] == [False, False, False, False, True, False]
    assert not Pipeline(GenerationConfig(max_new_tokens=5), Context(1, 5, [2])).forces(5)
