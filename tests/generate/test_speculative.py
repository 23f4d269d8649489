"""Speculative decoding (qkv.generate.speculative): greedy tokens equal plain greedy's (random and trained
tiny models, both drafters, with logits processors, eos, left padding, stream) and transformers' own
prompt-lookup and assisted generation; sampling distributed as the target model (the rejection rule alone
against a known p, and whole generations against the exact distribution of their tokens enumerated with
the model's forward); the cache rollback; the refusals."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from _genmodels import tiny_encdec, tiny_gpt
from scipy.stats import chisquare

import qkv
from qkv.generate import generate, stream
from qkv.generate.speculative import accept_or_resample, lookup_ngram
from qkv.nn.cache import StaticCache


def _pair(position: str, vocab: int = 11, context: int = 96):
    torch.manual_seed(0)
    target = tiny_gpt(position, vocab=vocab, context=context)
    torch.manual_seed(1)
    return target, tiny_gpt(position, vocab=vocab, context=context)


@pytest.mark.parametrize("position", ["rope", "learned", "alibi"])
@pytest.mark.parametrize("prompt_len", [1, 7])
def test_greedy_equals_plain_greedy(position, prompt_len):
    target, draft = _pair(position)
    torch.manual_seed(2)
    ids = torch.randint(0, 11, (1, prompt_len))
    want = generate(target, ids, max_new_tokens=50)
    lookup = generate(target, ids, max_new_tokens=50, prompt_lookup_num_tokens=4, return_dict=True)
    assisted = generate(target, ids, max_new_tokens=50, assistant_model=draft, num_assistant_tokens=3,
                        return_dict=True)
    itself = generate(target, ids, max_new_tokens=50, assistant_model=target, return_dict=True)
    for out in (lookup, assisted, itself):
        assert torch.equal(out.sequences, want)
    assert itself.speculation.acceptance_rate == 1.0  # its own drafts are always its choice
    assert lookup.speculation.forwards < 50  # drafts were accepted: fewer forwards than tokens
    assert assisted.speculation.drafted > 0


def test_greedy_with_processors_eos_padding_and_stream():
    target, draft = _pair("rope")
    ids = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]])
    opts = dict(max_new_tokens=40, repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=4,
                eos_token_id=10)
    want = generate(target, ids, **opts)
    assert want.shape[1] < ids.shape[1] + 40 and want[0, -1] == 10  # stopped at eos
    for extra in (dict(prompt_lookup_num_tokens=5), dict(assistant_model=draft)):
        assert torch.equal(generate(target, ids, **opts, **extra), want)
        streamed = torch.cat(list(stream(target, ids, **opts, **extra)))
        assert torch.equal(streamed, want[0, ids.shape[1]:])
    # one left-padded row: its positions start at the first real token
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], 1)
    got = generate(target, padded, attention_mask=mask, prompt_lookup_num_tokens=3, **opts)
    assert torch.equal(got[:, 3:], want)


def test_trained_model_copies_and_lookup_accepts():
    """A tiny model trained to count modulo 16: prompt lookup's drafts (the count seen in the prompt) are
    accepted, the tokens stay plain greedy's."""
    torch.manual_seed(0)
    model = tiny_gpt("rope", vocab=16, context=64, init_std=0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(60):
        x = (torch.randint(0, 16, (16, 1)) + torch.arange(24)) % 16
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4]])
    want = generate(model, ids, max_new_tokens=30)
    got = generate(model, ids, max_new_tokens=30, prompt_lookup_num_tokens=6, return_dict=True)
    assert torch.equal(got.sequences, want)
    assert torch.equal(want[0, 18:], (torch.arange(30) + 5) % 16)  # it learned to count
    assert got.speculation.acceptance_rate > 0.7
    assert got.speculation.forwards <= 10


def test_lookup_ngram_takes_the_longest_first_match():
    seq = torch.tensor([1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3])
    assert lookup_ngram(seq, 3, 2).tolist() == [9, 2, 3]  # "2 3" first occurs at 1: then 9 2 3
    assert lookup_ngram(seq, 3, 3).tolist() == [9, 2, 3]  # "1 2 3" as well
    assert lookup_ngram(torch.tensor([4, 5, 6]), 3, 2).tolist() == []
    assert lookup_ngram(torch.tensor([4, 5, 4]), 2, 2).tolist() == [5, 4]  # falls back to one token


def test_greedy_equals_transformers_prompt_lookup_and_assisted(tmp_path):
    transformers = pytest.importorskip("transformers")
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                initializer_range=0.3, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    folders = []
    for seed, layers in ((0, 2), (1, 1)):
        torch.manual_seed(seed)
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**base, "num_hidden_layers": layers}))
        hf.eval().save_pretrained(tmp_path / str(seed))
        folders.append(hf)
    target, draft = (qkv.from_pretrained(tmp_path / s) for s in ("0", "1"))
    ids = torch.tensor([[5, 9, 11, 5, 9, 11, 20, 5, 9]])
    hf_opts = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    ours = dict(max_new_tokens=24, eos_token_id=[])
    want = folders[0].generate(ids, prompt_lookup_num_tokens=4, **hf_opts)
    assert torch.equal(generate(target, ids, prompt_lookup_num_tokens=4, **ours), want)
    want = folders[0].generate(ids, assistant_model=folders[1], **hf_opts)
    assert torch.equal(generate(target, ids, assistant_model=draft, **ours), want)


def _chi2_p(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs * counts.sum() >= 1  # outcomes too rare to be expected even once are pooled
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(probs[keep], probs[~keep].sum()) * counts.sum()
    return float(chisquare(obs[exp > 0], exp[exp > 0]).pvalue)


def test_rejection_rule_samples_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.05, 0.2, 0.25, 0.0])
    q = torch.tensor([0.1, 0.4, 0.1, 0.1, 0.3])
    n = 6000
    drafts = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    counts = np.zeros(5)
    for d in drafts:
        counts[accept_or_resample(p, q, d, g)[0]] += 1
    assert counts[4] == 0  # a token the target never takes is never emitted
    assert _chi2_p(counts, p.numpy()) > 1e-3
    counts = np.zeros(5)  # a deterministic draft (prompt lookup): q one-hot at 1
    for _ in range(n):
        counts[accept_or_resample(p, None, 1, g)[0]] += 1
    assert _chi2_p(counts, p.numpy()) > 1e-3


def _exact_distribution(model, ids: torch.Tensor, n_new: int, vocab: int, temperature: float) -> np.ndarray:
    """P(each continuation of n_new tokens) by enumeration: the product of the model's softmax over the
    full forward, no cache and no sampling code involved."""
    conts = torch.tensor(list(itertools.product(range(vocab), repeat=n_new)))
    seqs = torch.cat([ids.expand(len(conts), -1), conts], 1)
    with torch.no_grad():
        logp = torch.log_softmax(model(seqs[:, :-1]).logits.double() / temperature, -1)
    t = ids.shape[1]
    picked = logp[:, t - 1:].gather(2, seqs[:, t:].unsqueeze(2)).squeeze(2)
    return picked.sum(1).exp().numpy()


def test_sampling_is_distributed_as_the_target():
    """Whole sampled continuations of 3 tokens over a 3-token vocabulary (27 outcomes), with each drafter,
    against the exact distribution; both drafters' drafts are partly rejected."""
    vocab, n_new = 3, 3
    target, draft = _pair("rope", vocab=vocab, context=32)
    ids = torch.tensor([[1, 2, 1, 2, 1]])
    probs = _exact_distribution(target, ids, n_new, vocab, temperature=0.8)
    assert abs(probs.sum() - 1) < 1e-9
    g = torch.Generator().manual_seed(0)
    for extra in (dict(prompt_lookup_num_tokens=2), dict(assistant_model=draft, num_assistant_tokens=2)):
        counts, stats = np.zeros(vocab ** n_new), [0, 0]
        for _ in range(500):
            out = generate(target, ids, max_new_tokens=n_new, do_sample=True, temperature=0.8, generator=g,
                           return_dict=True, eos_token_id=[], **extra)
            counts[int("".join(map(str, out.sequences[0, 5:].tolist())), vocab)] += 1
            stats[0] += out.speculation.accepted
            stats[1] += out.speculation.drafted
        assert 0 < stats[0] < stats[1]
        assert _chi2_p(counts, probs) > 1e-3


def test_cache_crop():
    c = StaticCache(1, 1, 1, 2, 8)
    c.update(0, torch.ones(1, 1, 5, 2), torch.ones(1, 1, 5, 2))
    c.advance(5)
    c.crop(3)
    assert c.length == 3
    with pytest.raises(ValueError, match="crop"):
        c.crop(4)


def test_refusals():
    target, draft = _pair("rope")
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="one sequence"):
        generate(target, ids.repeat(2, 1), prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="not both"):
        generate(target, ids, prompt_lookup_num_tokens=3, assistant_model=draft)
    with pytest.raises(ValueError, match="decoder-only"):
        generate(target, ids, assistant_model=tiny_encdec())
    with pytest.raises(ValueError, match="beam search"):
        generate(target, ids, assistant_model=draft, num_beams=2)
    with pytest.raises(qkv.config.ConfigError, match="prompt_lookup_num_tokens"):
        generate(target, ids, prompt_lookup_num_tokens=0)
