"""The Engine's speculative decoding: a running request drafts, and one forward checks.

Two drafters, as in `qkv generate --speculative`:

  prompt lookup   (a request's prompt_lookup_num_tokens, or EngineConfig.speculative="prompt-lookup" for
                  every request that sets none) the tokens that followed the first earlier occurrence of the
                  request's last n-gram in its own prompt + output (speculative.py's lookup_ngram).
  a draft model   (Engine(..., draft_model=small); `qkv serve --speculative FOLDER`) a small decoder of the
                  same vocabulary drafts k tokens for every request that does not ask for prompt lookup, one
                  step each over its own KV cache per request (speculative.py's AssistantDraft), through the
                  request's own logits processors and random generator.

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
from qkv.generate.engine_config import PROMPT_LOOKUP
from qkv.generate.scheduler import Request
from qkv.generate.speculative import (
    DEFAULT_NGRAM,
    AssistantDraft,
    Draft,
    SpeculationStats,
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
    """Every request's drafts and their check: the one owner of the draft model's per-request KV caches.

    The Engine asks draft(req) for a request's proposal, verify(...) for the tokens it emits after the
    verifying forward (the draft cache then keeps only the accepted tokens) or unused(req) when the draft is
    not checked, forget(id) when a request is cancelled, and retain(running) after each
    step: the state of a request that finished, was cancelled or was preempted (it is recomputed; the draft
    cache is rebuilt from its tokens when it decodes again) is dropped."""

    def __init__(self, speculative: str | None, tokens: int, draft_model: Any, vocab: int,
                 device: torch.device) -> None:
        if draft_model is not None and speculative == PROMPT_LOOKUP:
            raise ValueError(f"speculative={PROMPT_LOOKUP!r} and a draft_model: one drafter for the engine")
        if speculative not in (None, PROMPT_LOOKUP) and draft_model is None:
            raise ValueError(f"speculative={speculative!r} names a draft model: pass the loaded model as "
                             "draft_model= (qkv serve loads the folder)")
        self.model = None if draft_model is None else verifiable(draft_model, "draft model")
        # the tokens a request drafts per step when it sets none (None: the engine does not speculate)
        self.engine_tokens = tokens if speculative is not None or draft_model is not None else None
        self.vocab, self.device = vocab, device
        self.states: dict[int, AssistantDraft] = {}  # request id -> its draft model's cache
        self.stats = SpeculationStats()

    def draft(self, req: Request) -> Draft | None:
        """req's draft for this step: at most req.draft_tokens, and no more than its max_new_tokens leave
        after the target's own token; None when it decodes plainly this step."""
        if not req.draft_tokens or not req.output:
            return None
        k = min(req.draft_tokens, req.max_new_tokens - len(req.output) - 1)
        if k <= 0:
            return None
        if self.model is None or req.cfg.prompt_lookup_num_tokens:
            seq = torch.tensor(req.tokens, dtype=torch.long)
            found = lookup_ngram(seq, k, req.cfg.max_matching_ngram_size or DEFAULT_NGRAM)
            return Draft(found, None) if found.numel() else None
        return self._model_draft(req, k)

    def _model_draft(self, req: Request, k: int) -> Draft | None:
        """k tokens of the draft model after req's tokens, over its cache of req (built on first use: the
        request's whole sequence fed at once)."""
        total = len(req.prompt) + req.max_new_tokens
        limit = self.model.context_limit
        if limit is not None and total > limit:  # past the draft's position table: plain decoding
            return None
        state = self.states.get(req.id)
        fed = 0 if state is None else state.cache.length
        if max(req.tokens[fed:], default=0) >= self.model.output_vocab_size:  # a token the draft cannot read
            self.forget(req.id)
            return None
        if state is None:
            state = self.states[req.id] = AssistantDraft(self.model, req.draft_tokens, total, self.vocab,
                                                         req.pipe)
        cur = len(req.tokens)
        buf = torch.zeros(1, cur + k, dtype=torch.long, device=self.device)
        buf[0, :cur] = torch.tensor(req.tokens, dtype=torch.long)
        return state.propose(buf, cur, k)

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
        state = self.states.get(req.id)
        if state is not None:  # its cache keeps what it fed of the accepted tokens
            state.accepted(cur + len(toks))
        return toks

    def unused(self, req: Request) -> None:
        """req's draft was not checked (no free blocks for it): its draft cache forgets the drafts it fed."""
        state = self.states.get(req.id)
        if state is not None:
            state.cache.crop(min(state.cache.length, len(req.tokens)))

    def forget(self, request_id: int) -> None:
        self.states.pop(request_id, None)

    def retain(self, running: Iterable[Request]) -> None:
        """Drop the draft state of every request not in `running` (finished, cancelled, preempted)."""
        live = {r.id for r in running}
        for rid in [rid for rid in self.states if rid not in live]:
            del self.states[rid]
