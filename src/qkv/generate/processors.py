"""Logits processors: each generation option that reshapes the next-token distribution is one small class.

A processor maps (ids (B, cur) = the decoder sequence so far, scores (B, V)) -> scores, like Hugging Face's
LogitsProcessor, and builds itself from a GenerationConfig with `from_config(cfg, ctx)` (None when its
option is off). `PROCESSORS` run for every strategy (greedy, sampling, beam search on log-probabilities);
`WARPERS` only when sampling. The order is Hugging Face's (generation/utils.py _get_logits_processor).

A new option = one field in GenerationConfig + one class here, appended to PROCESSORS or WARPERS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from qkv.generate.config import GenerationConfig
from qkv.generate.grammar import Matcher, token_table
from qkv.generate.sampling import sample, top_k_filter, top_p_filter

NEG_INF = float("-inf")


@dataclass
class Context:
    """What the processors of one generation need beyond the config."""

    prompt_len: int  # decoder tokens before the first generated one (left padding / the start token included)
    max_new_tokens: int
    eos_ids: list[int]
    n_pad: Tensor | None = None  # (B,) left-padding tokens per row, not part of the text
    tokenizer: Any = None  # the caller's tokenizer: a grammar's vocabulary (GrammarMask)
    vocab_size: int | None = None  # the model's output columns (GrammarMask; None: the tokenizer's)


class LogitsProcessor:
    needs_ids: ClassVar[bool] = True  # reads the tokens so far (False: the scores alone)

    @classmethod
    def from_config(cls, cfg: GenerationConfig, ctx: Context) -> LogitsProcessor | None:  # pragma: no cover
        raise NotImplementedError

    def __call__(self, ids: Tensor, scores: Tensor) -> Tensor:  # pragma: no cover
        raise NotImplementedError

    def apply_(self, ids: Tensor, scores: Tensor) -> Tensor:
        """The same function, allowed to write into `scores` (a caller that owns them: beam search's
        log-probability buffer); returns the result, which may be `scores` itself or a new tensor."""
        return self(ids, scores)

    def forces(self, cur: int) -> bool:
        """True when this processor's output at decoder length `cur` does not depend on its input scores (it
        forces one token): the logits of that step need not be computed."""
        return False


# -- processors: every strategy -------------------------------------------------------------------------
class RepetitionPenalty(LogitsProcessor):
    """CTRL (Keskar et al. 2019): the logit of every token already in the sequence is divided by the penalty
    when positive and multiplied by it when negative (penalty > 1 discourages repeats). Left padding is not
    part of the sequence."""

    def __init__(self, penalty: float, n_pad: Tensor | None = None) -> None:
        self.penalty, self.n_pad = penalty, n_pad

    @classmethod
    def from_config(cls, cfg: GenerationConfig, ctx: Context) -> RepetitionPenalty | None:
        return cls(cfg.repetition_penalty, ctx.n_pad) if cfg.repetition_penalty != 1.0 else None

    def __call__(self, ids: Tensor, scores: Tensor) -> Tensor:
        V = scores.shape[-1]
        if self.n_pad is not None:  # padding -> the extra column V, dropped below
            pos = torch.arange(ids.shape[1], device=ids.device)
            ids = ids.masked_fill(pos[None, :] < self.n_pad.to(ids.device)[:, None], V)
        seen = torch.zeros(scores.shape[0], V + 1, dtype=torch.bool, device=scores.device)
        seen.scatter_(1, ids.clamp(0, V), True)
        seen = seen[:, :V]
        penalised = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
        return torch.where(seen, penalised, scores)


class NoRepeatNGram(LogitsProcessor):
    """No n-gram occurs twice in a row's sequence: a token that would complete an n-gram already present is
    banned (Paulus et al. 2018; fairseq / Hugging Face no_repeat_ngram_size)."""

    def __init__(self, n: int) -> None:
        self.n = n

    @classmethod
    def from_config(cls, cfg: GenerationConfig, ctx: Context) -> NoRepeatNGram | None:
        return cls(cfg.no_repeat_ngram_size) if cfg.no_repeat_ngram_size > 0 else None

    def banned(self, ids: Tensor) -> tuple[Tensor, Tensor] | None:
        """(rows, tokens) to ban: the token after every earlier occurrence of the row's last n-1 tokens. Index
        tensors, not a (B, V) mask (V is 58k for Marian), found by comparing all windows at once (the Python
        loop over rows and positions it replaces took, with a copy of the scores, ~5 ms a step at 64 beams x
        32 tokens)."""
        n, cur = self.n, ids.shape[1]
        if cur < n:  # no complete n-gram yet
            return None
        windows = ids.unfold(1, n, 1)  # (B, cur - n + 1, n): every n-gram, by start position
        if n > 1:
            prefix = ids[:, cur - n + 1:]  # (B, n - 1): the n-gram the next token would complete
            hit = (windows[:, :, : n - 1] == prefix.unsqueeze(1)).all(-1)
        else:
            hit = torch.ones(windows.shape[:2], dtype=torch.bool, device=ids.device)
        rows, start = hit.nonzero(as_tuple=True)
        if rows.numel() == 0:
            return None
        return rows, windows[rows, start, n - 1]

    def __call__(self, ids: Tensor, scores: Tensor) -> Tensor:
        index = self.banned(ids)
        if index is None:
            return scores
        return scores.index_put(tuple(i.to(scores.device) for i in index),
                                torch.tensor(NEG_INF, dtype=scores.dtype, device=scores.device))

    def apply_(self, ids: Tensor, scores: Tensor) -> Tensor:
        index = self.banned(ids)
        if index is None:
            return scores
        return scores.index_put_(tuple(i.to(scores.device) for i in index),
                                 torch.tensor(NEG_INF, dtype=scores.dtype, device=scores.device))


class NoBadWords(LogitsProcessor):
    """bad_words_ids: a banned one-token word is never produced; the last token of a longer banned sequence is
    banned right after its other tokens (Hugging Face's NoBadWordsLogitsProcessor; a lone eos is never
    banned)."""

    def __init__(self, words: list[list[int]], eos_ids: list[int]) -> None:
        words = [list(w) for w in words if not (len(w) == 1 and w[0] in eos_ids)]
        self.single = sorted({w[0] for w in words if len(w) == 1})
        self.longer = [w for w in words if len(w) > 1]

    @classmethod
    def from_config(cls, cfg: GenerationConfig, ctx: Context) -> NoBadWords | None:
        return cls(cfg.bad_words_ids, ctx.eos_ids) if cfg.bad_words_ids else None

    def __call__(self, ids: Tensor, scores: Tensor) -> Tensor:
        V = scores.shape[-1]
        banned = torch.zeros_like(scores, dtype=torch.bool)
        single = [t for t in self.single if t < V]
        if single:
            banned[:, single] = True
        for w in self.longer:
            k = len(w) - 1
            if w[-1] < V and ids.shape[1] >= k:
                hit = (ids[:, -k:] == torch.tensor(w[:-1], device=ids.device)).all(-1)
                banned[hit, w[-1]] = True
        return scores.masked_fill(banned, NEG_INF)


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's penalties over the GENERATED tokens (the prompt's do not count, unlike RepetitionPenalty):
    logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0), count[j] being how many
    times token j was generated so far in the row."""

    def __init__(self, presence: float, frequency: float, start: int) -> None:
        self.presence, self.frequency, self.start = presence, frequency, start

    @classmethod
    def from_config(cls, cfg: GenerationConfig, ctx: Context) -> PresenceFrequencyPenalty | None:
        if cfg.presence_penalty == 0 and cfg.frequency_penalty == 0:
            return None
        return cls(cfg.presence_penalty, cfg.frequency_penalty, ctx.prompt_len)

    def __call__(self, ids: Tensor, scores: Tensor) -> Tensor:
        out = ids[:, self.start:]
        if out.shape[1] == 0:
            return scores
        V = scores.shape[-1]
        counts = torch.zeros(scores.shape[0], V + 1, dtype=scores.dtype, device=scores.device)
        counts.scatter_add_(1, out.clamp(0, V).to(scores.device), torch.ones_like(out, dtype=scores.dtype))
        counts = counts[:, :V]
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class LogitBias(LogitsProcessor):
    """OpenAI's logit_bias: a fixed bias added to the logits of the listed token ids (-100 in practice bans
    a token, 100 forces it). Ids past the model's vocabulary are refused where the settings meet the model
    (inputs.check_special_ids, Engine._check, the server's 400); here they are left out."""

    needs_ids = False

    def __init__(self, bias: dict[int, float]) -> None:
        self.ids = torch.tensor(list(bias), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    @classmethod
    def from_config(cls, cfg: GenerationConfig, ctx: Context) -> LogitBias | None:
        return cls(cfg.logit_bias) if cfg.logit_bias else None

    def __call__(self, ids: Tensor, scores: Tensor) -> Tensor:
        keep = self.ids < scores.shape[-1]
        index = self.ids[keep].to(scores.device)
        return scores.index_add(1, index, self.values[keep].to(scores).expand(scores.shape[0], -1))


class MinNewTokens(LogitsProcessor):
    """eos is impossible until `min_new` tokens have been generated (min_new_tokens, or min_length counted
    as Hugging Face does: prompt included)."""

    def __init__(self, start: int, min_new: int, eos_ids: list[int]) -> None:
        self.start, self.min_new, self.eos = start, min_new, eos_ids

    @classmethod
    def from_config(cls, cfg: GenerationConfig, ctx: Context) -> MinNewTokens | None:
        n = cfg.min_tokens(ctx.prompt_len)
        return cls(ctx.prompt_len, n, ctx.eos_ids) if n > 0 and ctx.eos_ids else None

    def __call__(self, ids: Tensor, scores: Tensor) -> Tensor:
        if ids.shape[1] - self.start < self.min_new:
            scores = scores.clone()
            scores[:, self.eos] = NEG_INF
        return scores

    def apply_(self, ids: Tensor, scores: Tensor) -> Tensor:
        if ids.shape[1] - self.start < self.min_new:
            scores[:, self.eos] = NEG_INF
        return scores


class ForcedBOS(LogitsProcessor):
    """The first generated token is forced (mBART's target language id). Hugging Face forces it when the
    decoder sequence has length 1, i.e. right after an encoder-decoder's start token; here it is the first
    generated token of any model, which is the same thing for encoder-decoders."""

    def __init__(self, token: int, start: int) -> None:
        self.token, self.start = token, start

    @classmethod
    def from_config(cls, cfg: GenerationConfig, ctx: Context) -> ForcedBOS | None:
        return None if cfg.forced_bos_token_id is None else cls(cfg.forced_bos_token_id, ctx.prompt_len)

    def __call__(self, ids: Tensor, scores: Tensor) -> Tensor:
        if ids.shape[1] == self.start:
            scores = torch.full_like(scores, NEG_INF)
            scores[:, self.token] = 0
        return scores

    def forces(self, cur: int) -> bool:
        return cur == self.start


class ForcedEOS(LogitsProcessor):
    """The last token allowed by the length limit is forced to eos (BART, Marian)."""

    def __init__(self, max_length: int, eos_ids: list[int]) -> None:
        self.max_length, self.eos = max_length, eos_ids

    @classmethod
    def from_config(cls, cfg: GenerationConfig, ctx: Context) -> ForcedEOS | None:
        e = cfg.forced_eos_token_id
        if e is None:
            return None
        return cls(ctx.prompt_len + ctx.max_new_tokens, [e] if isinstance(e, int) else list(e))

    def __call__(self, ids: Tensor, scores: Tensor) -> Tensor:
        if ids.shape[1] == self.max_length - 1:
            scores = torch.full_like(scores, NEG_INF)
            scores[:, self.eos] = 0
        return scores

    def forces(self, cur: int) -> bool:
        return cur == self.max_length - 1


class GrammarMask(LogitsProcessor):
    """Structured output: only the tokens the grammar allows next (GenerationConfig.grammar: a JSON schema's,
    a tool call's; generate/grammar.py). One llguidance matcher per row, advanced by the tokens generated
    since the last call; where the grammar is done, only eos. Last among the processors: what it allows is
    what the warpers and the draw see."""

    def __init__(self, grammar: str, table: Any, start: int) -> None:
        self.grammar, self.table, self.start = grammar, table, start
        self.rows: list[Matcher] = []
        self.fed = 0  # generated tokens consumed by every row's matcher

    @classmethod
    def from_config(cls, cfg: GenerationConfig, ctx: Context) -> GrammarMask | None:
        if cfg.grammar is None:
            return None
        vocab = ctx.vocab_size if ctx.vocab_size is not None else len(ctx.tokenizer)
        return cls(cfg.grammar, token_table(ctx.tokenizer, vocab, ctx.eos_ids), ctx.prompt_len)

    def __call__(self, ids: Tensor, scores: Tensor) -> Tensor:
        if not self.rows:
            self.rows = [Matcher(self.table, self.grammar) for _ in range(ids.shape[0])]
        new = ids[:, self.start + self.fed:].tolist()
        self.fed = ids.shape[1] - self.start
        for row, toks in zip(self.rows, new):
            row.consume(toks)
        banned = np.stack([row.banned(scores.shape[-1]) for row in self.rows])
        return scores.masked_fill(torch.from_numpy(banned).to(scores.device), NEG_INF)


# -- warpers: sampling only -----------------------------------------------------------------------------
class Temperature(LogitsProcessor):
    needs_ids = False

    def __init__(self, t: float) -> None:
        self.t = t

    @classmethod
    def from_config(cls, cfg: GenerationConfig, ctx: Context) -> Temperature | None:
        return cls(cfg.temperature) if cfg.temperature != 1.0 else None

    def __call__(self, ids: Tensor, scores: Tensor) -> Tensor:
        return scores / self.t


class TopK(LogitsProcessor):
    needs_ids = False

    def __init__(self, k: int) -> None:
        self.k = k

    @classmethod
    def from_config(cls, cfg: GenerationConfig, ctx: Context) -> TopK | None:
        return cls(cfg.top_k) if cfg.top_k else None

    def __call__(self, ids: Tensor, scores: Tensor) -> Tensor:
        return top_k_filter(scores, self.k)


class TopP(LogitsProcessor):
    needs_ids = False

    def __init__(self, p: float) -> None:
        self.p = p

    @classmethod
    def from_config(cls, cfg: GenerationConfig, ctx: Context) -> TopP | None:
        return cls(cfg.top_p) if cfg.top_p is not None and cfg.top_p < 1.0 else None

    def __call__(self, ids: Tensor, scores: Tensor) -> Tensor:
        return top_p_filter(scores, self.p)


class MinP(LogitsProcessor):
    """Keep the tokens whose probability is at least min_p times the most likely one's (Nguyen et al. 2024);
    the most likely token is always kept. After temperature, as in llama.cpp and Hugging Face."""

    needs_ids = False

    def __init__(self, min_p: float) -> None:
        self.min_p = min_p

    @classmethod
    def from_config(cls, cfg: GenerationConfig, ctx: Context) -> MinP | None:
        return cls(cfg.min_p) if cfg.min_p else None  # 0 keeps every token: nothing to do

    def __call__(self, ids: Tensor, scores: Tensor) -> Tensor:
        probs = torch.softmax(scores.float(), dim=-1)
        top = probs.amax(dim=-1, keepdim=True)
        remove = probs < self.min_p * top
        remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
        return scores.masked_fill(remove, NEG_INF)


# OpenAI's penalties and logit_bias ahead of the bans (a bias never lifts a banned token), as vLLM applies
# them; the grammar's mask last: what it allows is what the warpers and the draw see
PROCESSORS: list[type[LogitsProcessor]] = [RepetitionPenalty, PresenceFrequencyPenalty, LogitBias,
                                           NoRepeatNGram, NoBadWords, MinNewTokens, ForcedBOS, ForcedEOS,
                                           GrammarMask]
WARPERS: list[type[LogitsProcessor]] = [Temperature, TopK, TopP, MinP]


class Pipeline:
    """The processors of one generation setting, and the token choice after them."""

    def __init__(self, cfg: GenerationConfig, ctx: Context, generator: torch.Generator | None = None) -> None:
        self.sampling = cfg.sampling
        self.processors = [p for cls in PROCESSORS if (p := cls.from_config(cfg, ctx)) is not None]
        self.warpers = ([w for cls in WARPERS if (w := cls.from_config(cfg, ctx)) is not None]
                        if self.sampling else [])
        self.generator = generator

    @property
    def needs_ids(self) -> bool:
        return any(p.needs_ids for p in self.processors + self.warpers)

    def process(self, ids: Tensor, scores: Tensor, *, inplace: bool = False) -> Tensor:
        """Every processor, in order (beam search calls this on log-probabilities). inplace=True: the caller
        owns `scores` and lets the processors write into them (no copy of a (B, V) tensor per processor)."""
        for p in self.processors:
            scores = p.apply_(ids, scores) if inplace else p(ids, scores)
        return scores

    def forces(self, cur: int) -> bool:
        """True when, at decoder length `cur`, a processor forces the token whatever the logits (forced
        BOS / EOS ignore their input scores, so the processors after them see only their output): the step's
        forward can be skipped when nothing reads the cache afterwards."""
        return any(p.forces(cur) for p in self.processors)

    def scores(self, ids: Tensor, logits: Tensor) -> Tensor:
        """(B, V) logits of the next position -> the scores the token is chosen from: every processor, and
        when sampling every warper (their softmax is the distribution of the draw)."""
        scores = self.process(ids, logits.float() if (self.processors or self.sampling) else logits)
        for w in self.warpers:
            scores = w(ids, scores)
        return scores

    def choose(self, ids: Tensor, logits: Tensor) -> Tensor:
        """(B, V) logits of the next position -> (B,) tokens: greedy, or a draw after the warpers."""
        scores = self.scores(ids, logits)
        return sample(scores, self.generator) if self.sampling else scores.argmax(-1)

