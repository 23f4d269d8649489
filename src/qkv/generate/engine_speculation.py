"""The Engine's speculative decoding: a running request drafts, and one forward checks.

Two drafters, as in `qkv generate --speculative`:

  prompt lookup   (a request's prompt_lookup_num_tokens, or EngineConfig.speculative="prompt-lookup" for
                  every request that sets none) the tokens that followed the first earlier occurrence of the
                  request's last n-gram in its own prompt + output (speculative.py's lookup_ngram).
  a draft model   (Engine(..., draft_model=small); `qkv serve --speculative FOLDER`) a small decoder of the
                  same vocabulary drafts k tokens for every request that does not ask for prompt lookup,
                  through the request's own logits processors and random generator (speculative.py's draw,
                  as generate()'s AssistantDraft). Its keys/values live in a paged cache of its own (the
                  engine's block size and block count), one sequence per request, and the drafting requests
                  go through it together: one forward for the tokens each has not fed yet (rows of equal
                  length together: a new request's whole sequence, else the one or two tokens since its last
                  draft), then one batched forward per further drafted position.

Its row of the step feeds [its last token, d_1 .. d_k]: k + 1 query positions over its paged cache, like a
prefill piece on a running sequence, and the target's logits at each position are checked by speculative.py's
rule (target_choices, the one `qkv generate --speculative` uses): greedy accepts while the drafted token is
the target's choice; sampling accepts d_i with probability min(1, p(d_i) / q(d_i)) (q: the draft model's
distribution, one-hot for a lookup) and else draws from normalise(max(p - q, 0)); then the target's own token
follows. Greedy tokens are plain decoding's, sampled ones distributed as plain sampling's.

Rollback: the sequence's cached length is cut back to the tokens accepted (the last token and the accepted
drafts; the newest token is fed next step, with the next draft), and the blocks past it go back to the pool
(PagedKVCache.truncate). The prefix cache registers only full blocks of accepted tokens. The draft model's
cache of the request is cropped to the same tokens.

Who decodes plainly instead: a request with a grammar (its matcher is advanced by every sequence scored, so
scoring drafts would advance it past tokens never emitted); one without output yet (its prompt's last token,
possibly an image's); a draft that finds no match, or that max_new_tokens leaves no room for; a draft whose
blocks are not free (speculation never preempts another request); a request longer than the draft model's
position table, or holding a token past the draft's vocabulary; a model whose step cannot return every
position's logits.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from qkv.generate.config import GenerationConfig
from qkv.generate.engine_config import PROMPT_LOOKUP, EngineConfig
from qkv.generate.scheduler import Request
from qkv.generate.speculative import (
    DEFAULT_NGRAM,
    Draft,
    SpeculationStats,
    draw,
    fit_vocab,
    lookup_ngram,
    target_choices,
    verifiable,
)

__all__ = ["Drafter", "SpeculationStats", "draft_length"]


def draft_length(cfg: GenerationConfig, engine_tokens: int | None) -> int:
    """The tokens a request drafts per decoding step (0: it decodes plainly): its own
    prompt_lookup_num_tokens, else the engine's (None: the engine does not speculate); 0 with a grammar."""
    if cfg.grammar is not None:
        return 0
    return cfg.prompt_lookup_num_tokens or engine_tokens or 0


class Drafter:
    """Every request's drafts and their check: the one owner of the draft model's KV cache.

    Each step the Engine asks draft(batch) for its decoding rows' proposals, verify(...) for the tokens a
    row emits after the verifying forward (the draft cache then keeps only the accepted tokens) or
    unused(req) when a draft is not checked (no free blocks for it), forget(id) when a request is
    cancelled, and retain(running) after the step: the draft sequence of a request that finished or was
    preempted (it is recomputed; its draft sequence is rebuilt from its tokens when it decodes again) gives
    its blocks back."""

    def __init__(self, config: EngineConfig, draft_model: Any, vocab: int, device: torch.device) -> None:
        spec = config.speculative
        if draft_model is not None and spec == PROMPT_LOOKUP:
            raise ValueError(f"speculative={PROMPT_LOOKUP!r} and a draft_model: one drafter for the engine")
        if spec not in (None, PROMPT_LOOKUP) and draft_model is None:
            raise ValueError(f"speculative={spec!r} names a draft model: pass the loaded model as "
                             "draft_model= (qkv serve loads the folder)")
        self.model = None if draft_model is None else verifiable(draft_model, "draft model")
        if self.model is not None:
            if not callable(getattr(self.model, "make_paged_cache", None)):
                raise ValueError(f"the draft model {type(draft_model).__name__} has no paged KV cache")
            where = next(draft_model.parameters()).device
            if where != torch.device(device):  # its cache lives with the model's, on the engine's device
                raise ValueError(f"the draft model is on {where}, the model on {device}: move it there")
        # the tokens a request drafts per step when it sets none (None: the engine does not speculate)
        speculates = spec is not None or draft_model is not None
        self.engine_tokens = config.speculative_tokens if speculates else None
        self.vocab, self.device = vocab, device
        self.cache = None if self.model is None else self.model.make_paged_cache(
            config.num_blocks, config.block_size, max_batch_size=config.max_batch_size, device=device)
        self.stats = SpeculationStats()

    @property
    def requests(self) -> set[int]:
        """The requests whose tokens the draft model's cache holds."""
        return set() if self.cache is None else set(self.cache.tables)

    def draft(self, batch: list[Request]) -> dict[int, Draft]:
        """The decoding rows' drafts, by request id: at most req.draft_tokens each, and no more than its
        max_new_tokens leave after the target's own token; a row without one decodes plainly."""
        out, by_model = {}, []
        for req in batch:
            if not req.draft_tokens or not req.output:
                continue
            k = min(req.draft_tokens, req.max_new_tokens - len(req.output) - 1)
            if k <= 0:
                continue
            if self.model is None or req.cfg.prompt_lookup_num_tokens:
                seq = torch.tensor(req.tokens, dtype=torch.long)
                found = lookup_ngram(seq, k, req.cfg.max_matching_ngram_size or DEFAULT_NGRAM)
                if found.numel():
                    out[req.id] = Draft(found, None)
            elif self._ready(req, k):
                by_model.append((req, k))
        if by_model:
            out.update(self._model_drafts(by_model))
        return out

    def _ready(self, req: Request, k: int) -> bool:
        """req's draft sequence holds a prefix of its tokens and has blocks for the rest and k - 1 drafts;
        False (its draft sequence dropped) where it cannot draft: a token past the draft's vocabulary, a
        sequence past its position table, no free blocks."""
        cache, n = self.cache, len(req.tokens)
        if req.id not in cache.tables:
            cache.add_sequence(req.id)
        if cache.lens[req.id] >= n:  # the newest token is always fed with the draft (its logits draft d_1)
            cache.truncate(req.id, n - 1)
        unfed = req.tokens[cache.lens[req.id]:]
        limit = self.model.context_limit
        if (max(unfed) >= self.model.output_vocab_size or (limit is not None and n + k - 1 > limit)
                or not cache.reserve(req.id, len(unfed) + k - 1)):
            self.forget(req.id)
            return False
        return True

    def _model_drafts(self, rows: list[tuple[Request, int]]) -> dict[int, Draft]:
        """The draft model's k tokens for each (request, k): its unfed tokens first, then one batched
        forward per drafted position; each token drawn through the request's own processors."""
        bufs = {}
        for req, k in rows:
            cur = len(req.tokens)
            bufs[req.id] = torch.zeros(1, cur + k, dtype=torch.long, device=self.device)
            bufs[req.id][0, :cur] = torch.tensor(req.tokens, dtype=torch.long)
        logits = self._catch_up([req for req, _ in rows])
        probs: dict[int, list[Tensor]] = {req.id: [] for req, _ in rows}
        live, i = rows, 0
        while live:
            for req, _ in live:
                at = len(req.tokens) + i
                tok, q = draw(req.pipe, bufs[req.id][:, :at], logits[req.id])
                bufs[req.id][0, at] = tok
                if q is not None:
                    probs[req.id].append(q)
            i += 1
            live = [(req, k) for req, k in live if i < k]
            if live:
                group = [req for req, _ in live]
                fed = [[int(bufs[r.id][0, len(r.tokens) + i - 1])] for r in group]
                logits = dict(zip((r.id for r in group), self._forward(group, fed).split(1)))
        return {req.id: Draft(bufs[req.id][0, len(req.tokens):].clone(),
                              torch.stack(probs[req.id]) if probs[req.id] else None) for req, _ in rows}

    def _catch_up(self, reqs: list[Request]) -> dict[int, Tensor]:
        """Feed each request's tokens that its draft sequence lacks (rows of equal count through one
        forward); returns each one's next-token logits (1, V)."""
        by_len: dict[int, list[Request]] = {}
        for req in reqs:
            by_len.setdefault(len(req.tokens) - self.cache.lens[req.id], []).append(req)
        out = {}
        for group in by_len.values():
            ids = [req.tokens[self.cache.lens[req.id]:] for req in group]
            out.update(zip((r.id for r in group), self._forward(group, ids).split(1)))
        return out

    def _forward(self, group: list[Request], ids: list[list[int]]) -> Tensor:
        """One draft-model forward of B rows of T tokens over its paged cache; the last position's logits
        (B, V) fitted to the target's vocabulary."""
        self.cache.set_active([r.id for r in group])
        x = torch.tensor(ids, dtype=torch.long, device=self.device)
        keep = self.cache.keep_mask(x.shape[1]) if len({self.cache.lens[r.id] for r in group}) > 1 else None
        return fit_vocab(self.model.step(x, self.cache, keep=keep), self.vocab)

    def verify(self, req: Request, logits: Tensor, proposal: Draft) -> list[int]:
        """The tokens req emits after its verifying forward: the accepted drafts and the target's own one.
        logits: (k + 1, V), position i predicting the token after req.tokens + drafts[:i]. RuntimeError
        when the request's settings break its token choice (non-finite scores), as in plain sampling."""
        cur = len(req.tokens)
        k = proposal.tokens.numel()
        buf = torch.zeros(1, cur + k + 1, dtype=torch.long, device=logits.device)
        buf[0, :cur] = torch.tensor(req.tokens, dtype=torch.long)
        proposal = Draft(proposal.tokens.to(logits.device),
                         None if proposal.probs is None else proposal.probs.to(logits.device))
        buf[0, cur:cur + k] = proposal.tokens
        toks = target_choices(req.pipe, buf, cur, logits.unsqueeze(0), proposal, self.stats)
        # the draft cache keeps the accepted drafts; the target's own token is fed with the next draft
        self._crop(req.id, cur + len(toks) - 1)
        return toks

    def unused(self, req: Request) -> None:
        """req's draft was not checked: its draft sequence forgets the drafts it fed."""
        self._crop(req.id, len(req.tokens))

    def _crop(self, request_id: int, n: int) -> None:
        if self.cache is not None and request_id in self.cache.tables:
            self.cache.truncate(request_id, min(self.cache.lens[request_id], n))

    def forget(self, request_id: int) -> None:
        if self.cache is not None and request_id in self.cache.tables:
            self.cache.free_sequence(request_id)

    def retain(self, running: Iterable[Request]) -> None:
        """Free the draft sequence of every request not in `running` (finished, cancelled, preempted)."""
        if self.cache is None:
            return
        live = {r.id for r in running}
        for rid in [rid for rid in self.cache.tables if rid not in live]:
            self.cache.free_sequence(rid)
