"""The Engine's speculative decoding by prompt lookup: a running request drafts, and one forward checks.

A request that speculates (its GenerationConfig's prompt_lookup_num_tokens, or EngineConfig.speculative for
every request that sets none) drafts, at each decoding step, the tokens that followed the first earlier
occurrence of its last n-gram in its own prompt + output (speculative.py's lookup_ngram: no second model).
Its row of the step feeds [its last token, d_1 .. d_k]: k + 1 query positions over its paged cache, like a
prefill piece on a running sequence, and the target's logits at each position are checked by speculative.py's
rule (target_choices, the one `qkv generate --speculative` uses): greedy accepts while the drafted token is
the target's choice, sampling accepts d_i with probability p(d_i) and else draws from p without it; then
the target's own token follows. Greedy tokens are plain decoding's, sampled ones distributed as plain
sampling's.

Rollback: the sequence's cached length is cut back to the tokens accepted (the last token and the accepted
drafts; the newest token is fed next step, with the next draft), and the blocks past it go back to the pool
(PagedKVCache.truncate). The prefix cache registers only full blocks of accepted tokens.

Who decodes plainly instead: a request with a grammar (its matcher is advanced by every sequence scored, so
scoring drafts would advance it past tokens never emitted); one without output yet (its prompt's last token,
possibly an image's); a draft that finds no match, or that max_new_tokens leaves no room for; a draft whose
blocks are not free (speculation never preempts another request); a model whose step cannot return every
position's logits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.generate.config import GenerationConfig
from qkv.generate.scheduler import Request
from qkv.generate.speculative import DEFAULT_NGRAM, Draft, SpeculationStats, lookup_ngram, target_choices

__all__ = ["SpeculationStats", "draft", "draft_length", "verify"]


def draft_length(cfg: GenerationConfig, engine_tokens: int | None) -> int:
    """The tokens a request drafts per decoding step (0: it decodes plainly): its own
    prompt_lookup_num_tokens, else the engine's (None: the engine does not speculate); 0 with a grammar."""
    if cfg.grammar is not None:
        return 0
    return cfg.prompt_lookup_num_tokens or engine_tokens or 0


def draft(req: Request) -> list[int]:
    """req's draft for this step: at most req.draft_tokens, and no more than its max_new_tokens leave after
    the target's own token; [] when it decodes plainly this step."""
    if not req.draft_tokens or not req.output:
        return []
    k = min(req.draft_tokens, req.max_new_tokens - len(req.output) - 1)
    if k <= 0:
        return []
    seq = torch.tensor(req.tokens, dtype=torch.long)
    return lookup_ngram(seq, k, req.cfg.max_matching_ngram_size or DEFAULT_NGRAM).tolist()


def verify(req: Request, logits: Tensor, drafted: list[int], stats: SpeculationStats) -> list[int]:
    """The tokens req emits after its verifying forward: the accepted drafts and the target's own one.
    logits: (k + 1, V), position i predicting the token after req.tokens + drafted[:i]. RuntimeError when
    the request's settings break its token choice (non-finite scores), as in plain sampling."""
    cur = len(req.tokens)
    buf = torch.tensor([req.tokens + drafted + [0]], dtype=torch.long, device=logits.device)
    proposed = Draft(buf[0, cur:cur + len(drafted)].clone(), None)  # deterministic: q one-hot
    return target_choices(req.pipe, buf, cur, logits.unsqueeze(0), proposed, stats)
