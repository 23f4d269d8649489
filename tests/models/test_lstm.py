"""LSTM baseline: loss definitions against torch references, padding invariance, cached decoding,
generate, parameter counting and size matching, checkpoints, config errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.config import ConfigError
from qkv.models.lstm import LSTM, LSTMConfig, hidden_for_params, lstm_num_parameters


def lm(**kw):
    return LSTM(LSTMConfig(vocab_size=11, d_model=16, n_layers=2, **kw)).eval()


def clf(**kw):
    return LSTM(LSTMConfig(vocab_size=11, d_model=16, n_layers=2, mode="classify", num_labels=4,
                           bidirectional=True, **kw)).eval()


def test_lm_loss_is_shifted_next_token_cross_entropy():
    m = lm()
    x = torch.randint(0, 11, (3, 7))
    labels = x.clone()
    labels[0, :3] = -100
    out = m(x, labels=labels)
    assert out.logits.shape == (3, 7, 11)
    ref = F.cross_entropy(out.logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, ref)
    assert int(out.n_targets) == 3 * 6 - 2  # positions 1, 2 of row 0 are ignored
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_lm_is_causal():
    m = lm()
    x = torch.randint(0, 11, (2, 9))
    y = x.clone()
    y[:, 6:] = (y[:, 6:] + 1) % 11
    torch.testing.assert_close(m(x).logits[:, :6], m(y).logits[:, :6])


def test_classify_loss_and_shapes():
    m = clf()
    x = torch.randint(0, 11, (5, 8))
    labels = torch.tensor([0, 1, 2, 3, 1])
    out = m(x, labels=labels)
    assert out.logits.shape == (5, 4) and out.pooled.shape == (5, 32)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, labels))
    assert int(out.n_targets) == 5


@pytest.mark.parametrize("left", [False, True])
def test_classify_ignores_padding(left):
    """A padded row gives exactly the logits of the same sequence alone, unpadded."""
    m = clf()
    seqs = [torch.randint(6, 11, (n,)) for n in (3, 8, 5)]
    T = 8
    ids = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.long)
    for b, s in enumerate(seqs):
        sl = slice(T - len(s), T) if left else slice(0, len(s))
        ids[b, sl], mask[b, sl] = s, 1
    batched = m(ids, attention_mask=mask).logits
    for b, s in enumerate(seqs):
        torch.testing.assert_close(batched[b], m(s[None]).logits[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="all padding"):
        m(ids, attention_mask=torch.zeros_like(mask))


def test_cached_steps_equal_the_full_forward():
    m = lm()
    x = torch.randint(0, 11, (2, 10))
    full = m(x).logits
    cache = m.make_cache(2)
    parts = [m(x[:, :4], cache=cache).logits] + [m(x[:, t:t + 1], cache=cache).logits for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == 10


def test_generate_greedy_matches_a_manual_argmax_loop():
    m = lm()
    prompt = torch.randint(0, 11, (2, 4))
    out = m.generate(prompt, 6)
    seq = prompt
    for _ in range(6):  # no cache: recompute on the whole sequence each step
        seq = torch.cat([seq, m(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)
    # eos stops a row and pads it afterwards
    first = int(seq[0, 4])
    stopped = m.generate(prompt[:1], 6, eos_token_id=first, pad_token_id=0)
    assert stopped.tolist() == [prompt[0].tolist() + [first]]


def test_generate_left_padded_prompts_match_unpadded():
    m = lm()
    a, b = torch.randint(6, 11, (1, 5)), torch.randint(6, 11, (1, 2))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)])
    mask = torch.tensor([[1] * 5, [0, 0, 0, 1, 1]])
    out = m.generate(ids, 4, attention_mask=mask)
    assert torch.equal(out[0, 5:], m.generate(a, 4)[0, 5:])
    assert torch.equal(out[1, 5:], m.generate(b, 4)[0, 2:])


def test_generate_sampling_is_seeded():
    m = lm()
    p = torch.randint(0, 11, (3, 2))
    a = m.generate(p, 8, do_sample=True, temperature=1.5, top_k=5, seed=4)
    assert torch.equal(a, m.generate(p, 8, do_sample=True, temperature=1.5, top_k=5, seed=4))
    assert not torch.equal(a, m.generate(p, 8, do_sample=True, temperature=1.5, top_k=5, seed=5))
    # a vanishing nucleus keeps only the most likely token: sampling becomes greedy
    torch.testing.assert_close(m.generate(p, 8, do_sample=True, top_p=1e-6, seed=1), m.generate(p, 8))
    # the shared generate() brings beam search to the LSTM (it used to refuse num_beams): one beam is greedy
    from qkv.generate import beam_search

    assert torch.equal(beam_search(m, p, 8, num_beams=1).sequences, m.generate(p, 8))
    assert m.generate(p, 4, num_beams=4).shape == (3, 6)


@pytest.mark.parametrize("kw", [
    dict(), dict(tie_embeddings=False), dict(n_layers=3, vocab_size=100),
    dict(mode="classify", bidirectional=True, num_labels=10), dict(mode="classify", num_labels=3, n_layers=1),
])
def test_parameter_count_formula(kw):
    cfg = LSTMConfig(**{"vocab_size": 37, "d_model": 24, "n_layers": 2, **kw})
    m = LSTM(cfg)
    assert lstm_num_parameters(cfg) == m.num_parameters() == sum(
        p.numel() for p in {id(p): p for p in m.parameters()}.values())


def test_hidden_for_params_matches_a_transformer():
    gpt = qkv.build("gpt-tiny", vocab_size=109)
    target = gpt.num_parameters()
    base = LSTMConfig(vocab_size=109, n_layers=2)
    d = hidden_for_params(target, base)
    got = lstm_num_parameters(LSTMConfig(vocab_size=109, n_layers=2, d_model=d))
    # closest: one unit wider or narrower is no closer
    for other in (d - 1, d + 1):
        assert abs(got - target) <= abs(lstm_num_parameters(LSTMConfig(vocab_size=109, n_layers=2,
                                                                       d_model=other))
                                        - target)
    assert abs(got - target) / target < 0.01
    assert qkv.build("lstm-tiny", vocab_size=109, d_model=d).num_parameters() == got


def test_save_and_reload(tmp_path):
    m = qkv.build("lstm-tiny", vocab_size=20, d_model=32)
    m.save_pretrained(tmp_path)
    back = qkv.from_pretrained(tmp_path)
    assert isinstance(back, LSTM) and back.config == m.config
    x = torch.randint(0, 20, (2, 6))
    torch.testing.assert_close(back(x).logits, m(x).logits)
    assert back.lm_head.weight is back.tok_emb.weight  # tying survives the round trip


def test_config_errors():
    with pytest.raises(ConfigError, match="bidirectional"):
        qkv.build("lstm-tiny", bidirectional=True)
    with pytest.raises(ConfigError, match="mode"):
        qkv.build("lstm-tiny", mode="translate")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm()(torch.tensor([[3, 11]]))
    with pytest.raises(ValueError, match="mode=lm"):
        clf().generate(torch.tensor([[1, 2]]), 2)


# -- the shared generate() reproduces the LSTM's former decoding loop ---------------------------------------
@torch.no_grad()
def old_lstm_loop(m, input_ids, max_new, attention_mask=None, do_sample=False, temperature=1.0, top_k=None,
                  top_p=None, eos=None, pad=0, seed=None):
    """The loop LSTM.generate ran before it moved onto qkv.generate, written out from the model's modules:
    the recurrent state over the prompt (held over left padding), then argmax or a draw per step."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None

    def run(ids, state):  # embedding -> LSTM -> tied head, last position
        h, state = m.lstm(m.tok_emb(ids), state)
        return m.lm_head(h[:, -1]), state

    keep = None if attention_mask is None else attention_mask.bool()
    if keep is None or bool(keep.all()):
        logits, state = run(input_ids, None)
    else:
        state, logits = None, None
        for t in range(input_ids.shape[1]):
            out, new = run(input_ids[:, t:t + 1], state)
            k = keep[:, t].view(1, -1, 1)
            state = (new[0] * k, new[1] * k) if state is None else \
                (torch.where(k, new[0], state[0]), torch.where(k, new[1], state[1]))
            logits = out if logits is None else torch.where(keep[:, t:t + 1], out, logits)
    seq = input_ids.clone()
    done = torch.zeros(seq.shape[0], dtype=torch.bool)
    for _ in range(max_new):
        logits = logits.float()
        if do_sample and temperature > 0:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            if top_p is not None:
                sl, order = logits.sort(-1, descending=True)
                probs = sl.softmax(-1)
                drop = probs.cumsum(-1) - probs >= top_p
                logits = logits.scatter(-1, order, sl.masked_fill(drop, float("-inf")))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        nxt = nxt.masked_fill(done, pad)
        seq = torch.cat([seq, nxt.unsqueeze(1)], 1)
        if eos is not None:
            done |= nxt == eos
            if bool(done.all()):
                break
        logits, state = run(nxt.unsqueeze(1), state)
    return seq


@pytest.mark.parametrize("padded", [False, True])
def test_shared_generate_equals_the_former_lstm_loop(padded):
    m = LSTM(LSTMConfig(vocab_size=11, d_model=24, n_layers=2)).eval()
    with torch.no_grad():  # a sharper distribution than the U(-0.1, 0.1) init, so samples are not uniform
        m.tok_emb.weight.mul_(20)
    if padded:
        ids = torch.tensor([[0, 0, 3, 4, 5], [6, 7, 8, 9, 10], [0, 0, 0, 1, 2]])
        mask = (torch.arange(5) >= torch.tensor([[2], [0], [3]])).long()
    else:
        ids, mask = torch.randint(0, 11, (3, 4)), None
    greedy = old_lstm_loop(m, ids, 9, mask)
    assert torch.equal(m.generate(ids, 9, attention_mask=mask), greedy)
    assert len(set(greedy[:, -9:].flatten().tolist())) > 2  # not a constant continuation
    for kw in (dict(temperature=1.3), dict(temperature=0.8, top_k=4), dict(top_p=0.7),
               dict(top_k=6, top_p=0.9)):
        ref = old_lstm_loop(m, ids, 9, mask, do_sample=True, seed=11, **kw)
        assert torch.equal(m.generate(ids, 9, attention_mask=mask, do_sample=True, seed=11, **kw), ref), kw
    eos = int(greedy[0, ids.shape[1] + 2])  # row 0 stops after three tokens
    ref = old_lstm_loop(m, ids, 9, mask, eos=eos, pad=0)
    assert torch.equal(m.generate(ids, 9, attention_mask=mask, eos_token_id=eos, pad_token_id=0), ref)
