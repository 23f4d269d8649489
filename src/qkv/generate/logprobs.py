"""Log-probabilities a request asks the Engine for (OpenAI's logprobs / top_logprobs and echo's prompt
log-probabilities): log_softmax of the model's raw logits (before temperature, penalties or filters, as
OpenAI's and vLLM's default), the chosen token's and the `top` most likely tokens'.

One entry per token: TokenLogprob(logprob of the token, [(id, logprob) of the top ones, most likely first]).
A prompt's first token has no entry (None): nothing precedes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from qkv.generate.config import MAX_TOP_LOGPROBS

__all__ = ["MAX_TOP_LOGPROBS", "TokenLogprob", "token_logprobs"]


@dataclass
class TokenLogprob:
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # most likely first


def token_logprobs(logits: Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """(k, V) logits rows -> one entry per row for tokens[row] with its `top` most likely tokens."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    if top <= 0:
        return [TokenLogprob(c) for c in chosen]
    values, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)
    return [TokenLogprob(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]
