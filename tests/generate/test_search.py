"""Decoding loops: left-padded batches, per-sequence stopping, beam search (greedy case and exhaustive
search), context overflow, streaming, stop strings, attention weights, the fast decoding step."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from _genmodels import POSITIONS, tiny_encdec, tiny_gpt

from qkv.generate import beam_search, generate, stream


def left_pad(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(map(len, prompts))
    ids = torch.tensor([[pad] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("use_cache", [True, False])
def test_left_padded_batch_equals_each_prompt_alone(position, use_cache):
    m = tiny_gpt(position, gqa=True)
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6, 5], [8], [9, 7, 9, 3]]
    ids, mask = left_pad(prompts)
    out = generate(m, ids, 8, attention_mask=mask, use_cache=use_cache)
    for i, p in enumerate(prompts):
        alone = generate(m, torch.tensor([p]), 8)
        assert out[i, -8:].tolist() == alone[0, -8:].tolist()
        assert out[i, : ids.shape[1]].tolist() == ids[i].tolist()


def test_encdec_padded_batch_equals_each_source_alone():
    m = tiny_encdec("rope", gqa=True)
    srcs = [[3, 4, 5, 6, 7], [8, 9], [10, 3, 5]]
    T = 5
    ids = torch.tensor([s + [0] * (T - len(s)) for s in srcs])
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in srcs])
    out = generate(m, ids, 7, attention_mask=mask, eos_token_id=None)
    for i, s in enumerate(srcs):
        assert out[i].tolist() == generate(m, torch.tensor([s]), 7, eos_token_id=None)[0].tolist()


def test_right_padding_is_rejected():
    m = tiny_gpt()
    with pytest.raises(ValueError, match="LEFT-padded"):
        generate(m, torch.tensor([[1, 2, 0]]), 2, attention_mask=torch.tensor([[1, 1, 0]]))


def test_per_sequence_eos_stopping_and_padding():
    m = tiny_gpt("learned")
    x = torch.randint(0, 11, (4, 3))
    free = generate(m, x, 10)[:, 3:]
    eos = int(free[0, 2])  # row 0 produces this token at step 3
    out = generate(m, x, 10, eos_token_id=eos, pad_token_id=10)[:, 3:]
    for r in range(4):
        row = free[r].tolist()
        stop = row.index(eos) + 1 if eos in row else len(row)
        assert out[r, :stop].tolist() == row[:stop]
        assert (out[r, stop:] == 10).all()
    assert out.shape[1] == max((free[r].tolist().index(eos) + 1) if eos in free[r].tolist() else 10
                               for r in range(4))


def test_stream_yields_the_same_tokens_as_generate():
    m = tiny_gpt("alibi")
    ids, mask = left_pad([[1, 2, 3], [4, 5]])
    eos = int(generate(m, ids, 6, attention_mask=mask)[1, -4])
    full = generate(m, ids, 12, attention_mask=mask, eos_token_id=eos)
    steps = list(stream(m, ids, 12, attention_mask=mask, eos_token_id=eos))
    assert torch.equal(torch.stack(steps, 1), full[:, ids.shape[1]:])
    s = list(stream(m, ids, 5, do_sample=True, seed=1))
    assert torch.equal(torch.stack(s, 1), generate(m, ids, 5, do_sample=True, seed=1)[:, 3:])


def test_stream_does_not_leave_grad_disabled():
    m = tiny_gpt()
    it = stream(m, torch.tensor([[1, 2]]), 3)
    next(it)
    assert torch.is_grad_enabled()
    it.close()


def test_stop_strings_with_a_tokenizer():
    m = tiny_gpt("rope")
    x = torch.tensor([[1, 2, 3]])
    decode = lambda ids: "".join(chr(ord("a") + i) for i in ids)  # noqa: E731
    free = generate(m, x, 12)[0, 3:].tolist()
    target = decode(free[3:5])  # the continuation's 4th and 5th characters
    text = decode(free)
    stop_at = next(i for i in range(1, len(text) + 1) if target in text[:i])
    out = generate(m, x, 12, stop_strings=[target], tokenizer=decode, pad_token_id=0)[0, 3:].tolist()
    assert out[:stop_at] == free[:stop_at] and len(out) == stop_at
    with pytest.raises(ValueError, match="tokenizer"):
        generate(m, x, 3, stop_strings=["x"])
    crit = generate(m, x, 12, stopping_criteria=lambda seq, new: new == free[1])[0, 3:].tolist()
    assert crit == free[: free.index(free[1]) + 1]


def test_context_overflow_error_and_slide():
    m = tiny_gpt("learned", context=16)
    x = torch.randint(0, 11, (1, 10))
    with pytest.raises(ValueError, match="context"):
        generate(m, x, 7)
    assert generate(m, x, 6).shape == (1, 16)
    out = generate(m, x, 14, context_overflow="slide")
    assert out.shape == (1, 24)
    with torch.no_grad():
        for t in range(10, 24):  # every token is the argmax over the last 16 tokens before it
            window = out[:, max(0, t - 16) : t]
            assert int(m(window).logits[0, -1].argmax()) == int(out[0, t])
    assert torch.equal(out, generate(m, x, 14, context_overflow="slide", use_cache=False))
    rope = tiny_gpt("rope", context=16)
    with pytest.warns(UserWarning, match="20 positions runs past the model's context_length of 16") as caught:
        assert generate(rope, x, 10).shape == (1, 20)  # RoPE has no hard limit: a warning, not an error
    assert caught[0].filename == __file__  # it points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert generate(rope, x, 6).shape == (1, 16)  # within the context: no warning
    with pytest.raises(ValueError, match="context"):
        generate(tiny_encdec(context=8), torch.tensor([[3, 4]]), 8)


def test_return_attentions_match_full_forward():
    m = tiny_gpt("alibi", backend="naive", gqa=True)
    x = torch.tensor([[1, 2, 3, 4]])
    out = generate(m, x, 4, return_attentions=True)
    assert len(out.attentions) == 4
    with torch.no_grad():
        full = m(out.sequences[:, :-1], return_attentions=True).attentions
    for step, layers in enumerate(out.attentions):
        Tk = 4 + step
        for layer, w in enumerate(layers):
            torch.testing.assert_close(w["self"][:, :, -1], full[layer]["self"][:, :, Tk - 1, :Tk])
    e = generate(tiny_encdec(backend="naive"), torch.tensor([[3, 4, 5]]), 3, return_attentions=True,
                 eos_token_id=None)
    assert e.attentions[2][0]["cross"].shape == (1, 4, 1, 3)


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("placement,norm,ffn",
                         [("pre", "layernorm", "gelu_tanh"), ("post", "rmsnorm", "swiglu")])
def test_fast_step_logits_equal_full_forward(position, placement, norm, ffn):
    m = tiny_gpt(position, gqa=True, placement=placement, norm=norm, ffn=ffn)
    ids, mask = left_pad([[1, 2, 3, 4, 5], [6, 7]])
    n_pad = torch.tensor([0, 3])
    with torch.no_grad():
        cache = m.make_cache(2, 12)
        m(ids, attention_mask=mask, cache=cache, offset=-n_pad)
        seq, keep = ids, mask
        for _ in range(5):
            nxt = torch.randint(0, 11, (2, 1))
            seq, keep = torch.cat([seq, nxt], 1), torch.cat([keep, torch.ones(2, 1, dtype=torch.long)], 1)
            got = m.step(nxt, cache, keep=keep.bool(), offset=cache.length - n_pad)
            full = m(seq, attention_mask=keep, offset=-n_pad).logits[:, -1]
            torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)


# -- beam search -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["gpt", "encdec"])
def test_beam_search_with_one_beam_is_greedy(family):
    m = tiny_gpt("rope") if family == "gpt" else tiny_encdec("learned")
    x = torch.randint(3, 11, (3, 4))
    greedy = generate(m, x, 8, eos_token_id=None)
    beam = beam_search(m, x, 8, num_beams=1, eos_token_id=None).sequences
    assert torch.equal(beam, greedy)
    eos = int(greedy[0, -5])
    g2 = generate(m, x, 8, eos_token_id=eos, pad_token_id=0)
    b2 = beam_search(m, x, 8, num_beams=1, length_penalty=0.0, eos_token_id=eos, pad_token_id=0).sequences
    assert torch.equal(b2, g2[:, : b2.shape[1]]) and (g2[:, b2.shape[1]:] == 0).all()


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0, -0.5])
def test_beam_search_matches_exhaustive_search(length_penalty):
    V, eos, n_new = 4, 3, 3
    m = tiny_gpt("learned", vocab=V, init_std=0.8)
    prompt = torch.tensor([[0, 2, 1]])
    # every complete hypothesis: ends with eos at length L <= n_new, or has n_new tokens without eos
    hyps = []
    for L in range(1, n_new + 1):
        for toks in itertools.product(range(V), repeat=L):
            if eos in toks[:-1] or (toks[-1] != eos and L < n_new):
                continue
            seq = torch.cat([prompt, torch.tensor([toks])], 1)
            with torch.no_grad():
                logp = torch.log_softmax(m(seq).logits[0, 2:-1].double(), -1)
            total = sum(float(logp[i, t]) for i, t in enumerate(toks))
            hyps.append((total / L**length_penalty, list(toks)))
    hyps.sort(key=lambda h: -h[0])
    out = beam_search(m, prompt, n_new, num_beams=V**n_new, length_penalty=length_penalty, eos_token_id=eos,
                      num_return_sequences=5, pad_token_id=0)
    for i in range(5):
        got = out.sequences[i, 3:].tolist()
        assert got[: len(hyps[i][1])] == hyps[i][1]
        assert abs(float(out.scores[i]) - hyps[i][0]) < 1e-4


def test_beam_search_cache_and_batch_consistency():
    m = tiny_gpt("alibi", gqa=True)
    ids, mask = left_pad([[1, 2, 3], [4, 5, 6, 7, 8]])
    a = generate(m, ids, 6, attention_mask=mask, num_beams=3, num_return_sequences=2, eos_token_id=5,
                 return_dict=True)
    b = generate(m, ids, 6, attention_mask=mask, num_beams=3, num_return_sequences=2, eos_token_id=5,
                 use_cache=False, return_dict=True)
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(a.scores, b.scores)
    assert (a.scores[0] >= a.scores[1]) and (a.scores[2] >= a.scores[3])
    alone = generate(m, torch.tensor([[4, 5, 6, 7, 8]]), 6, num_beams=3, eos_token_id=5)
    assert a.sequences[2, : alone.shape[1]].tolist() == alone[0].tolist()
    e = tiny_encdec()
    src = torch.randint(3, 11, (2, 5))
    assert torch.equal(generate(e, src, 6, num_beams=4), generate(e, src, 6, num_beams=4, use_cache=False))


def test_generate_keeps_training_mode():
    m = tiny_gpt().train()
    generate(m, torch.tensor([[1]]), 2)
    assert m.training


def _count_rows(model, monkeypatch) -> list[int]:
    """Record the batch size of every forward the decoding loop asks of `model` (prefill or step)."""
    rows: list[int] = []
    for name in ("prefill", "step"):
        fn = getattr(model, name)
        monkeypatch.setattr(model, name,
                            lambda ids, *a, _fn=fn, **k: (rows.append(ids.shape[0]), _fn(ids, *a, **k))[1])
    return rows


@pytest.mark.parametrize("family", ["encdec", "gpt"])
def test_beam_search_prefills_one_row_per_input_and_skips_the_forced_last_step(family, monkeypatch):
    """The first step runs on one row per input (its K beams start identical), later steps on all K beams;
    with forced_eos_token_id the last step's token is forced, so it runs no forward, and the result (tokens
    and scores) is the same as with that step computed. That the tokens are Hugging Face's is tested in
    tests/interop/test_seq2seq_parity.py; that they are the exhaustive optimum in
    test_beam_search_matches_exhaustive_search."""
    from qkv.generate import processors

    torch.manual_seed(0)
    if family == "encdec":
        m, x, mask = tiny_encdec(), torch.randint(3, 11, (3, 5)), None
    else:
        m = tiny_gpt("learned")
        x, mask = left_pad([[1, 2, 3], [4, 5, 6, 7, 8], [9]])
    opts = dict(num_beams=4, max_new_tokens=7, eos_token_id=2, forced_eos_token_id=2, no_repeat_ngram_size=2,
                length_penalty=0.6, num_return_sequences=2, return_dict=True, attention_mask=mask)
    rows = _count_rows(m, monkeypatch)
    out = generate(m, x, **opts)
    skipped = list(rows)
    monkeypatch.setattr(processors.ForcedEOS, "forces", lambda self, cur: False)
    rows.clear()
    full = generate(m, x, **opts)
    assert full.sequences.shape == out.sequences.shape and torch.equal(full.sequences, out.sequences)
    assert torch.equal(full.scores, out.scores)
    assert rows == [3] + [12] * 6  # every row open to the end (the case is not vacuous)
    assert skipped == [3] + [12] * 5  # the last, forced step ran no forward


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("chunk", [1, 2])
def test_shared_cross_attention_kv_equals_the_repeated_one(gqa, chunk):
    """Beam search keeps the encoder K/V at one row per source and the attention step lets the R beams of a
    source share them (grouped rows of one batched matmul). The decoding step's logits equal those over K/V
    repeated for every row (cache.reorder with cross=True) and the full forward over the repeated memory,
    with a padded source (the cross-attention mask in the grouped layout), GQA, one- and two-token steps."""
    torch.manual_seed(0)
    m = tiny_encdec(gqa=gqa)
    src = torch.randint(3, 11, (3, 6))
    src_mask = torch.ones_like(src)
    src_mask[1, 4:] = 0
    src_mask[2, 2:] = 0
    R = 4
    rows = torch.arange(3).repeat_interleave(R)
    with torch.no_grad():
        source = m.encode_source(src, src_mask)
        shared, repeated = m.make_cache(3, 12), m.make_cache(3, 12)
        start = torch.full((3, 1), 1)
        for c in (shared, repeated):
            m.prefill(start, c, source=source)
        shared.reorder(rows, cross=False)
        repeated.reorder(rows)
        assert shared.get_cross(0)[0].shape[0] == 3 and repeated.get_cross(0)[0].shape[0] == 12
        seq = start.index_select(0, rows)
        big = source.select_rows(rows)
        for _ in range(3):
            nxt = torch.randint(3, 11, (12, chunk))
            seq = torch.cat([seq, nxt], 1)
            a, b = m.step(nxt, shared), m.step(nxt, repeated)
            full = m.decode(seq, big.memory, memory_mask=big.mask)[0][:, -1]
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a, full, atol=1e-5, rtol=1e-5)
            assert not torch.equal(a[0], a[4])  # the sources differ: the case is not vacuous


@pytest.mark.parametrize("V", [8192, 58101, 9000 + 77])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_two_stage_row_topk_equals_torch_topk(V, k):
    """beam search's top-k per row (block maxima, then the best blocks' entries) gives torch.topk's values and
    indices: distinct values, banned (-inf) entries, a row whose best entries share one block, a row whose
    best entry is in the tail past the last full block, and rows with fewer finite entries than blocks."""
    from qkv.generate import search

    g = torch.Generator().manual_seed(V + k)
    x = torch.randn(6, V, generator=g, dtype=torch.float64).float()
    x[:, ::5] = float("-inf")  # no_repeat_ngram / bad words bans
    x[1, 300:300 + k] = 50.0 + torch.arange(k, dtype=torch.float32)  # all k best in one block
    x[2, V - 1] = 99.0  # the very last entry (the tail when V is not a multiple of the block)
    x[3, :] = float("-inf")
    x[3, [7, V // 2]] = torch.tensor([1.0, 2.0])  # only 2 finite entries
    assert V // search.TOPK_BLOCK >= k and V >= search.TOPK_TWO_STAGE_MIN  # the two-stage path runs
    s, i = search._row_topk(x, k)
    ref_s, ref_i = x.topk(k, dim=1)
    assert torch.equal(s, ref_s)
    finite = ref_s > float("-inf")  # the order of the equal -inf entries is unspecified in both
    assert torch.equal(i[finite], ref_i[finite])
    assert torch.equal(x.gather(1, i), s)


@pytest.mark.parametrize("name, value", [
    ("pad_token_id", 11), ("pad_token_id", -1), ("eos_token_id", 99), ("eos_token_id", [3, -2]),
    ("forced_bos_token_id", -3), ("forced_eos_token_id", 11), ("bad_words_ids", [[99]]),
])
@pytest.mark.parametrize("beams", [1, 2])
def test_special_token_ids_outside_the_vocabulary_are_refused(name, value, beams):
    """A pad id is fed to the model for finished rows, an eos id outside the vocabulary never stops, a forced
    or banned one indexes past the logits (negative: wraps around): each is one clear error before any step
    runs."""
    model = tiny_gpt()  # vocab 11
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match=f"{name} .* outside the model's vocabulary \\[0, 11\\)"):
        generate(model, ids, 4, num_beams=beams, **{name: value})


def test_encoder_decoder_token_ids_must_be_a_batch():
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, length\), got shape \(5,\)"):
        generate(tiny_encdec(), torch.tensor([1, 2, 3, 4, 5]), 4)


def test_max_length_below_the_prompt_is_refused():
    """max_length counts the prompt: one at or below its length would generate nothing (transformers
    refuses)."""
    model, ids = tiny_gpt(), torch.tensor([[1, 2, 3, 4, 5]])
    for n in (3, 5):
        with pytest.raises(ValueError, match=f"max_length={n} counts the prompt, which has 5 tokens"):
            generate(model, ids, max_length=n)
    assert generate(model, ids, max_length=7).shape == (1, 7)


def test_beam_search_takes_the_models_num_beams(monkeypatch):
    """beam_search() uses 4 beams only when neither the call, its config nor the model's defaults say how many
    (the beams it runs are recorded: on a tiny model 3 and 4 beams may well return the same tokens)."""
    import qkv.generate.search as search

    used, run = [], search._beam_search
    monkeypatch.setattr(search, "_beam_search", lambda m, ids, cfg, mask: used.append(cfg.num_beams) or
                        run(m, ids, cfg, mask))
    model = tiny_gpt()
    ids = torch.tensor([[1, 2, 3]])
    model.folder_generation_config = {"num_beams": 3}
    try:
        assert torch.equal(beam_search(model, ids, 5).sequences, generate(model, ids, 5, num_beams=3))
        beam_search(model, ids, 5, num_beams=2)
    finally:
        model.folder_generation_config = {}
    beam_search(model, ids, 5)
    assert used == [3, 3, 2, 4]  # the folder's 3 (beam_search, then generate's), the call's 2, the default 4


@pytest.mark.parametrize("prompt, error", [
    (torch.tensor([1.7, 2.2]), "1-D integer token ids"), (torch.tensor([[1, 2]]), "1-D integer token ids"),
    ([1, 2.5], "list of int token ids, got float 2.5"), ([1, True], "list of int token ids, got bool True"),
])
def test_engine_refuses_prompts_that_are_not_token_ids(prompt, error):
    from qkv.generate.engine import Engine

    engine = Engine(tiny_gpt(), block_size=4, max_new_tokens=3)
    with pytest.raises(TypeError, match=error):
        engine.add_request(prompt)
    import numpy as np

    rid = engine.add_request(np.array([1, 2, 3]))  # numpy integers are integers
    assert len(engine.run()[rid]) == 3
