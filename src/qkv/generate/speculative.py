"""Speculative decoding: draft k tokens cheaply, check them with one forward of the target model.

At batch 1 on a CPU a decoding step is bound by reading the weights; a forward over k + 1 tokens reads them
once too, so every accepted draft is a token for (almost) nothing. Two drafters, named as in transformers:

  prompt_lookup_num_tokens=N   n-gram lookup (Saxena 2023, transformers' PromptLookupCandidateGenerator): the
                               last max_matching_ngram_size..1 tokens are searched in the sequence so far,
                               and the N tokens that followed their first occurrence are the draft. No second
                               model; it pays where the output copies the input (rewriting, editing, quoting).
  assistant_model=draft        a small model of the same tokenizer drafts num_assistant_tokens tokens, one
                               step each over its own KV cache.

Verification. The target's forward over [the last token, d_1..d_k] (model.verify) gives the k + 1 next-token
distributions, each after the same logits processors as plain decoding (Pipeline.scores over the sequence
with the drafts before it). Greedy: drafts are accepted while each equals the target's choice, then the
target's own token follows; the tokens are plain greedy's (a (k + 1)-token forward rounds differently from
k + 1 one-token steps, so two near-tied logits may order differently, as with any change of kernel).
Sampling: the rejection rule (Leviathan et al. 2023; Chen et al. 2023): d_i, drawn from the draft's q, is
accepted with probability min(1, p(d_i) / q(d_i)); at the first rejection a token is drawn from
normalise(max(p - q, 0)), and after k acceptances one more from p. Every emitted token is then distributed
exactly as under plain sampling. A prompt-lookup draft is deterministic (q one-hot at d): accepted with
probability p(d), else a draw from p without d.

Rollback. Both caches are cropped to the accepted length (StaticCache.crop): positions past it are never
attended, and the next forward overwrites them. Batch 1, decoder-only models, eager steps (no compile).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qkv.generate.processors import Context, Pipeline
from qkv.models.decoding import Decoder, as_decoder

DEFAULT_NGRAM = 2  # transformers' max_matching_ngram_size default


@dataclass
class SpeculationStats:
    """What speculation did in one generation: drafted and accepted tokens, verifying forwards."""

    drafted: int = 0
    accepted: int = 0
    forwards: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class Draft:
    tokens: Tensor  # (k,) proposed tokens
    probs: Tensor | None  # (k, V) the distributions they were drawn from; None: deterministic (one-hot)


def lookup_ngram(seq: Tensor, num_tokens: int, max_ngram: int) -> Tensor:
    """The tokens that followed the first earlier occurrence of seq's last n tokens, for n from max_ngram
    down to 1 (the longest match wins), at most num_tokens of them; empty when nothing matches. seq: (T,)."""
    n_seq = seq.numel()
    for n in range(min(max_ngram, n_seq - 1), 0, -1):
        hits = (seq.unfold(0, n, 1) == seq[-n:]).all(1).nonzero().flatten()
        start = int(hits[0]) + n  # the last window always matches itself: hits is never empty
        if start < n_seq:
            return seq[start: start + num_tokens]
    return seq[:0]


def verifiable(model: Any, role: str) -> Decoder:
    """`model` as a decoder that speculative decoding can use (a clear error for one it cannot)."""
    dec = as_decoder(model)
    if dec.is_seq2seq or not callable(getattr(dec, "verify", None)):
        raise ValueError(f"speculative decoding: the {role} must be a decoder-only Transformer over a KV "
                         f"cache (model.verify), not {type(model).__name__}")
    return dec


class PromptLookup:
    """Drafts by n-gram lookup in the sequence so far."""

    def __init__(self, num_tokens: int, max_ngram: int | None) -> None:
        self.num_tokens, self.max_ngram = num_tokens, max_ngram or DEFAULT_NGRAM

    def propose(self, buf: Tensor, cur: int, k: int) -> Draft:
        return Draft(lookup_ngram(buf[0, :cur], min(k, self.num_tokens), self.max_ngram), None)

    def accepted(self, cur: int) -> None:
        """The sequence now has `cur` valid tokens (nothing to roll back)."""


def fit_vocab(logits: Tensor, vocab: int) -> Tensor:
    """A draft model's logits (B, V') fitted to the target's vocabulary V: a larger draft vocabulary is cut,
    a smaller one padded with -inf (those tokens are never drafted)."""
    v = logits.shape[-1]
    if v > vocab:
        return logits[:, :vocab]
    if v < vocab:
        return torch.nn.functional.pad(logits, (0, vocab - v), value=float("-inf"))
    return logits


def draw(pipe: Pipeline, ids: Tensor, logits: Tensor) -> tuple[Tensor, Tensor | None]:
    """One drafted token (1,) after the sequence ids (1, T) from the draft's logits (1, V), through the
    target's processors: the argmax when greedy, else a draw from the processed distribution q, returned
    with it ((V,): the rejection rule's q)."""
    scores = pipe.scores(ids, logits)
    if not pipe.sampling:
        return scores.argmax(-1), None
    q = torch.softmax(scores.float(), dim=-1)
    return torch.multinomial(q, 1, generator=pipe.generator).view(1), q[0]


class AssistantDraft:
    """Drafts with a small model over its own cache, through the same logits processors as the target."""

    def __init__(self, model: Any, num_tokens: int, total: int, vocab: int, pipe: Pipeline) -> None:
        self.model = verifiable(model, "assistant_model")
        self.num_tokens, self.vocab, self.pipe = num_tokens, vocab, pipe
        self.cache = self.model.make_cache(1, total)

    def _logits(self, ids: Tensor) -> Tensor:
        """The draft's next-token logits after feeding ids, fitted to the target's vocabulary."""
        if self.cache.length == 0:
            logits, _ = self.model.prefill(ids, self.cache)
        else:
            logits = self.model.step(ids, self.cache)
        return fit_vocab(logits, self.vocab)

    def propose(self, buf: Tensor, cur: int, k: int) -> Draft:
        """k = min(k, num_assistant_tokens) drafts, written into buf[:, cur:cur + k] (the target overwrites
        them from the first rejection on)."""
        k = min(k, self.num_tokens)
        tokens, probs = [], []
        ids = buf[:, self.cache.length: cur]
        for i in range(k):
            tok, p = draw(self.pipe, buf[:, : cur + i], self._logits(ids))
            if p is not None:
                probs.append(p)
            buf[:, cur + i] = tok
            tokens.append(tok)
            ids = buf[:, cur + i: cur + i + 1]
        toks = torch.cat(tokens) if tokens else buf[0, :0]
        return Draft(toks, torch.stack(probs) if probs else None)

    def accepted(self, cur: int) -> None:
        """The sequence now has `cur` valid tokens: the draft's cache keeps what it fed of them."""
        self.cache.crop(min(self.cache.length, cur - 1))


def accept_or_resample(p: Tensor, q: Tensor | None, d: int,
                       generator: torch.Generator | None) -> tuple[int, bool]:
    """One position of the rejection rule: p (V,) the target's distribution, q (V,) the draft's (None:
    d was certain), d the drafted token. Returns (token, accepted): d with probability min(1, p(d) / q(d)),
    else a draw from normalise(max(p - q, 0))."""
    q_d = 1.0 if q is None else float(q[d])
    u = float(torch.rand((), generator=generator, device=p.device))
    if u * q_d < float(p[d]):
        return d, True
    if q is None:
        rest = p.clone()
        rest[d] = 0
    else:
        rest = (p - q).clamp_min(0)
    if float(rest.sum()) <= 0:  # p == q up to rounding: the rejection had probability ~0
        rest = p
    return int(torch.multinomial(rest, 1, generator=generator)), False


def target_choices(pipe: Pipeline, buf: Tensor, cur: int, logits: Tensor, draft: Draft,
                    stats: SpeculationStats) -> list[int]:
    """The tokens the target emits after one verifying forward: the accepted drafts and one of its own.
    logits: (1, k + 1, V), position i predicting buf[:, cur + i]."""
    k = draft.tokens.numel()
    out: list[int] = []
    for i in range(k + 1):
        scores = pipe.scores(buf[:, : cur + i], logits[:, i])
        if not pipe.sampling:
            tok = int(scores.argmax(-1))
            ok = i < k and tok == int(draft.tokens[i])
        elif i < k:
            p = torch.softmax(scores.float(), dim=-1)[0]
            q = None if draft.probs is None else draft.probs[i]
            tok, ok = accept_or_resample(p, q, int(draft.tokens[i]), pipe.generator)
        else:
            p = torch.softmax(scores.float(), dim=-1)
            tok, ok = int(torch.multinomial(p, 1, generator=pipe.generator)), False
        buf[0, cur + i] = tok
        out.append(tok)
        if not ok:
            break
    stats.drafted += k
    stats.accepted += len(out) - 1
    stats.forwards += 1
    return out


def speculative_loop(s: Any, stop: Callable[[Tensor, Tensor], Tensor] | None, *, generator: Any,
                     assistant_model: Any, stats: SpeculationStats) -> Iterator[Tensor]:
    """Greedy or sampled decoding of one sequence with drafts checked by model.verify; yields each new (1,)
    token and writes it into s.buf (s: the generation's search._Run). Stops at eos, a stop criterion or
    max_new_tokens."""
    model, cfg = verifiable(s.model, "model"), s.cfg
    if s.B != 1:
        raise ValueError("speculative decoding runs one sequence (batch 1, num_return_sequences=1), got "
                         f"{s.B} rows")
    if s.slide or not cfg.use_cache:
        raise ValueError("speculative decoding needs the KV cache within the model's context (use_cache, "
                         "no context_overflow='slide')")
    pipe = Pipeline(cfg, Context(s.T, s.max_new, s.eos, s.n_pad), generator)
    vocab = model.output_vocab_size
    if assistant_model is not None:
        draft_pipe = Pipeline(cfg, Context(s.T, s.max_new, s.eos, s.n_pad), generator)
        drafter: Any = AssistantDraft(assistant_model, cfg.num_assistant_tokens, s.total, vocab, draft_pipe)
    else:
        drafter = PromptLookup(cfg.prompt_lookup_num_tokens, cfg.max_matching_ngram_size)
    cache = model.make_cache(1, s.total)
    if s.T > 1:  # the prompt but its last token, by the full forward (it handles left padding's masked rows)
        keep = None if s.keep is None else s.keep[:, : s.T - 1]
        model.prefill(s.buf[:, : s.T - 1], cache, keep=keep, offset=None if s.n_pad is None else -s.n_pad)
    eos = set(s.eos)
    cur, produced = s.T, 0
    while produced < s.max_new:
        draft = drafter.propose(s.buf, cur, s.max_new - produced - 1)
        k = draft.tokens.numel()
        s.buf[0, cur: cur + k] = draft.tokens
        keep = None if s.keep is None else s.keep[:, : cur + k]
        offset = None if s.n_pad is None else cache.length - s.n_pad
        logits = model.verify(s.buf[:, cache.length: cur + k], cache, keep=keep, offset=offset,
                              n_logits=k + 1)
        for tok in target_choices(pipe, s.buf, cur, logits, draft, stats):
            cur += 1
            produced += 1
            new = s.buf[:, cur - 1]
            yield new
            if tok in eos or (stop is not None and bool(stop(s.buf[:, :cur], new).all())):
                return
        cache.crop(cur - 1)  # the newest token is fed with the next drafts
        drafter.accepted(cur)


__all__ = ["Draft", "SpeculationStats", "accept_or_resample", "draw", "fit_vocab", "lookup_ngram",
           "speculative_loop", "target_choices"]
