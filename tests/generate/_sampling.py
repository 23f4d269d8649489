"""The exact next-tokens distribution of a tiny model and a chi-square check of samples against it: what the
speculative engines' sampling tests share (prompt lookup and a draft model must both sample as plain
decoding does)."""

from __future__ import annotations

import itertools

import torch
from scipy.stats import chisquare


def exact_sequences(model, prompt: list[int], n: int, V: int) -> dict[tuple[int, ...], float]:
    """P(the n new tokens) under plain sampling at temperature 1: every sequence's product of softmaxes,
    from one batched forward over all V ** n continuations."""
    seqs = list(itertools.product(range(V), repeat=n))
    x = torch.tensor([prompt + list(s) for s in seqs])
    with torch.no_grad():
        lp = torch.log_softmax(model(x).logits.double(), -1)
    P = len(prompt)
    total = sum(lp[:, P - 1 + i].gather(1, x[:, P + i:P + i + 1]).squeeze(1) for i in range(n))
    return {s: float(p) for s, p in zip(seqs, total.exp())}


def assert_samples_match(samples: list[list[int]], exact: dict[tuple[int, ...], float],
                         min_p: float = 1e-3) -> None:
    """Chi-square of the sampled sequences' counts against N * the exact probabilities: p-value > min_p.
    Cells expected fewer than 5 times are pooled into one (chi-square's rule of thumb)."""
    counts = dict.fromkeys(exact, 0)
    for s in samples:
        counts[tuple(s)] += 1
    keys = sorted(exact)
    expected = [exact[k] * len(samples) for k in keys]
    big = [i for i, e in enumerate(expected) if e >= 5]
    rest = [i for i in range(len(keys)) if i not in big]
    obs = [counts[keys[i]] for i in big] + [sum(counts[keys[i]] for i in rest)]
    exp = [expected[i] for i in big] + [sum(expected[i] for i in rest)]
    exp = [e * sum(obs) / sum(exp) for e in exp]
    assert chisquare(obs, exp).pvalue > min_p
