"""The decoding loops: greedy / sampling (one token per sequence per step) and beam search.

One implementation serves every decoder through `_Decoder`, a small adapter that turns "the ids fed this
step" into next-token logits: GPT runs `model(ids, cache=...)`; the encoder-decoder encodes the source once
and runs `model.decode(ids, memory, cache=...)`, whose cross-attention keys/values are projected once and
kept in the cache.

Left padding. A batch of prompts of different lengths is padded on the left (attention_mask 0 there), so
every sequence's newest token is in the last column and one (B, 1) step serves all. The keys of the padding
are masked out, and each sequence gets its own position offset so that its first real token is position 0:
offset = -n_pad at prefill, then (cache length - n_pad). Positions below 0 are clamped inside positions()
and only ever belong to masked padding.

Hot path (one cached step): the next tokens are written into a preallocated (B, T + new) buffer, never
concatenated; the key mask is a slice of a preallocated buffer and is None when nothing is padded; a
single query needs no causal mask (attention.py); the cache writes in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from qkv.generate.fastpath import FastGPTStep
from qkv.generate.sampling import check_sampling_args, process_logits, sample
from qkv.nn.cache import StaticCache

ContextOverflow = Literal["error", "slide"]
# stopping_criteria(sequences (B, T_so_far), new_tokens (B,)) -> (B,) bool: True = this sequence stops now
StoppingCriteria = Callable[[Tensor, Tensor], Tensor]


@dataclass
class GenerationOutput:
    """What generate(..., return_dict=True) (or return_attentions=True) returns."""

    sequences: Tensor  # GPT: (N, T + new) prompt + continuation; encoder-decoder: (N, new)
    scores: Tensor | None = None  # beam search: (N,) length-penalised log-probability of each sequence
    # per generated step: the per-layer dicts {"self": (B, H, Tq, Tk), "cross": (B, H, Tq, S)}
    attentions: list[list[dict[str, Tensor]]] = field(default_factory=list)


class _Decoder:
    """Next-token logits of any qkv decoder, given the ids fed this step."""

    def __init__(self, model: Any, input_ids: Tensor, attention_mask: Tensor | None) -> None:
        self.model = model
        self.seq2seq = hasattr(model, "encode")
        c = model.config
        if self.seq2seq:
            self.memory, _ = model.encode(input_ids, attention_mask)
            self.memory_mask = attention_mask
            self.vocab = c.target_vocab_size
            self.context: int | None = c.context_length  # decode() always enforces it
        else:
            self.memory = self.memory_mask = None
            self.vocab = c.vocab_size
            # only absolute encodings (learned, sinusoidal) have a hard limit; RoPE/ALiBi/none extrapolate
            self.context = model.decoder.position.max_len
        # the lean one-token step over a StaticCache (fastpath.py); None where the model is not eligible
        self.fast = None if self.seq2seq else FastGPTStep.get(model)

    def expand(self, n: int) -> None:
        """Repeat each batch row n times (beams, several samples per prompt)."""
        if self.seq2seq and n > 1:
            self.memory = self.memory.repeat_interleave(n, 0)
            if self.memory_mask is not None:
                self.memory_mask = self.memory_mask.repeat_interleave(n, 0)

    def make_cache(self, batch_size: int, max_len: int) -> Any:
        return self.model.make_cache(batch_size, max_len)

    def __call__(self, ids: Tensor, cache: Any, keep: Tensor | None, offset: Tensor | None,
                 return_attentions: bool) -> tuple[Tensor, list | None]:
        """-> (B, V) logits of the last position, attention weights when asked."""
        if (self.fast is not None and ids.shape[1] == 1 and type(cache) is StaticCache and not return_attentions
                and cache.length > 0):
            return self.fast(ids, cache, keep, offset), None
        if self.seq2seq:
            logits, out = self.model.decode(
                ids, self.memory, memory_mask=self.memory_mask, decoder_attention_mask=keep, cache=cache,
                offset=offset, return_attentions=return_attentions, last_only=True)
            return logits[:, -1], out.attentions
        out = self.model(ids, attention_mask=keep, cache=cache, offset=offset,
                         return_attentions=return_attentions, last_only=True)
        return out.logits[:, -1], out.attentions


def _as_id_list(x: int | Sequence[int] | None) -> list[int]:
    if x is None:
        return []
    return [int(x)] if isinstance(x, int) else [int(i) for i in x]


def _left_padding(attention_mask: Tensor | None, shape: torch.Size) -> Tensor | None:
    """(B,) number of left-padding tokens, or None when every token is real. Rejects other layouts."""
    if attention_mask is None:
        return None
    if attention_mask.shape != shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(shape)}")
    m = attention_mask.bool()
    if bool(m.all()):
        return None
    n_real = m.sum(1)
    if bool((n_real == 0).any()):
        raise ValueError("a prompt in the batch is all padding (attention_mask row of zeros)")
    # left padding: row b is 0 for its first n_pad positions and 1 after
    expect = torch.arange(m.shape[1], device=m.device).unsqueeze(0) >= (m.shape[1] - n_real).unsqueeze(1)
    if not torch.equal(m, expect):
        raise ValueError("generate needs LEFT-padded prompts (padding first, attention_mask 0...0 1...1); "
                         "right padding would put pad tokens between the prompt and its continuation")
    return (m.shape[1] - n_real).long()


class _Setup:
    """Everything both loops share: checked options, the decoder, the prompt buffer and its mask."""

    def __init__(self, model: Any, input_ids: Tensor, max_new_tokens: int, attention_mask: Tensor | None,
                 eos_token_id: int | Sequence[int] | None, pad_token_id: int | None,
                 context_overflow: str, expand: int) -> None:
        from qkv.models.base import check_token_ids

        seq2seq = hasattr(model, "encode")  # its input is the encoder's (ids, or audio for Whisper)
        if not seq2seq and input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        if input_ids.shape[-1] == 0:
            raise ValueError("input_ids is empty: give at least one prompt token")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if context_overflow not in ("error", "slide"):
            raise ValueError(f"context_overflow must be 'error' or 'slide', got {context_overflow!r}")
        c = model.config
        self.dec = _Decoder(model, input_ids, attention_mask)
        self.seq2seq = self.dec.seq2seq
        if not self.seq2seq:
            check_token_ids(input_ids, self.dec.vocab)  # once per call; generated ids are in range by construction
        self.eos = _as_id_list(eos_token_id if eos_token_id is not None else getattr(c, "eos_token_id", None))
        if pad_token_id is None:
            pad_token_id = getattr(c, "pad_token_id", None)
            if pad_token_id is None:
                pad_token_id = self.eos[0] if self.eos else 0
        self.pad = int(pad_token_id)
        if self.seq2seq:
            start = int(c.bos_token_id)
            prompt = torch.full((input_ids.shape[0], 1), start, dtype=torch.long, device=input_ids.device)
            n_pad = None
        else:
            prompt, n_pad = input_ids.long(), _left_padding(attention_mask, input_ids.shape)
        if expand > 1:
            prompt = prompt.repeat_interleave(expand, 0)
            n_pad = None if n_pad is None else n_pad.repeat_interleave(expand, 0)
            self.dec.expand(expand)
        self.prompt, self.n_pad = prompt, n_pad
        self.B, self.T = prompt.shape
        self.total = self.T + max_new_tokens
        ctx = self.dec.context
        self.slide = False
        if ctx is not None and self.total > ctx:
            if context_overflow == "error":
                what = "1 start token" if self.seq2seq else f"prompt of {self.T} tokens"
                raise ValueError(
                    f"{what} + max_new_tokens={max_new_tokens} = {self.total} positions exceeds the model's "
                    f"context of {ctx}; shorten the prompt, lower max_new_tokens, or pass "
                    f"context_overflow='slide' to recompute on the last {ctx} tokens")
            self.slide = True
        self.ctx = ctx
        dev = prompt.device
        self.buf = torch.full((self.B, self.total), self.pad, dtype=torch.long, device=dev)
        self.buf[:, : self.T] = prompt
        self.keep = None
        if n_pad is not None:
            self.keep = torch.ones(self.B, self.total, dtype=torch.bool, device=dev)
            self.keep[:, : self.T] = torch.arange(self.T, device=dev).unsqueeze(0) >= n_pad.unsqueeze(1)
        self.eos_t = torch.tensor(self.eos, dtype=torch.long, device=dev) if self.eos else None

    def logits(self, cache: Any, cur: int, inp: Tensor, return_attentions: bool) -> tuple[Tensor, list | None, Any]:
        """Logits for the next position after buf[:, :cur]. Returns (logits, attentions, cache); the cache
        is dropped (None) once a sliding window takes over."""
        if cache is not None and cur > cache.max_len:
            cache = None  # the cache is full: from here on, recompute over the window
        if cache is not None:
            keep = None if self.keep is None else self.keep[:, :cur]
            offset = None if self.n_pad is None else cache.length - self.n_pad
            logits, att = self.dec(inp, cache, keep, offset, return_attentions)
            return logits, att, cache
        lo = max(0, cur - self.ctx) if (self.slide and self.ctx is not None) else 0
        keep = None if self.keep is None else self.keep[:, lo:cur]
        offset = None
        if self.n_pad is not None:  # the first real token of each row is position 0 of the window
            offset = -(self.n_pad - lo).clamp_min(0)
        logits, att = self.dec(self.buf[:, lo:cur], None, keep, offset, return_attentions)
        return logits, att, None

    def new_cache(self, use_cache: bool) -> Any:
        if not use_cache:
            return None
        size = self.total if not self.slide else self.ctx
        return self.dec.make_cache(self.B, size)


def _stop_fn(stop_strings: Sequence[str] | None, tokenizer: Any, stopping_criteria: StoppingCriteria | None,
             start: int) -> StoppingCriteria | None:
    """Combine stop strings (decoded with tokenizer.decode, or a callable ids -> str) and a user criterion."""
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer (an object with .decode(ids) or a callable ids -> str)")
    if not stop_strings and stopping_criteria is None:
        return None
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    decode = tokenizer.decode if hasattr(tokenizer, "decode") else tokenizer

    def check(seq: Tensor, new: Tensor) -> Tensor:
        done = torch.zeros(seq.shape[0], dtype=torch.bool, device=seq.device)
        if stop_strings:
            for b in range(seq.shape[0]):
                text = decode(seq[b, start:].tolist())  # the continuation only, never the prompt
                done[b] = any(s in text for s in stop_strings)
        if stopping_criteria is not None:
            done |= torch.as_tensor(stopping_criteria(seq, new), dtype=torch.bool, device=seq.device)
        return done

    return check


def _decode_loop(s: _Setup, max_new_tokens: int, *, do_sample: bool, temperature: float, top_k: int | None,
                 top_p: float | None, generator: torch.Generator | None, use_cache: bool,
                 stop: StoppingCriteria | None, return_attentions: bool,
                 attentions: list | None) -> Iterator[Tensor]:
    """Greedy or sampled decoding; yields the (B,) new tokens of each step (pad for finished rows) and
    writes them into s.buf."""
    cache = s.new_cache(use_cache)
    sampling = do_sample and temperature > 0
    per_row = s.eos_t is not None or stop is not None
    done = torch.zeros(s.B, dtype=torch.bool, device=s.buf.device) if per_row else None
    cur, inp = s.T, s.prompt
    for _ in range(max_new_tokens):
        logits, att, cache = s.logits(cache, cur, inp, return_attentions)
        if attentions is not None:
            attentions.append(att)
        if sampling:
            nxt = sample(process_logits(logits.float(), temperature=temperature, top_k=top_k, top_p=top_p),
                         generator)
        else:
            nxt = logits.argmax(-1)
        if done is not None:
            nxt = nxt.masked_fill(done, s.pad)  # finished rows only receive padding
        s.buf[:, cur] = nxt
        cur += 1
        if done is not None:
            if s.eos_t is not None:
                done |= torch.isin(nxt, s.eos_t)
            if stop is not None:
                done |= stop(s.buf[:, :cur], nxt)
            yield nxt
            if bool(done.all()):
                return
        else:
            yield nxt
        inp = s.buf[:, cur - 1 : cur]


def _result(s: _Setup, n: int) -> Tensor:
    out = s.buf[:, : s.T + n]
    return out[:, 1:] if s.seq2seq else out


@torch.no_grad()
def beam_search(model: Any, input_ids: Tensor, max_new_tokens: int = 32, *, num_beams: int = 4,
                length_penalty: float = 1.0, num_return_sequences: int = 1, attention_mask: Tensor | None = None,
                eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
                use_cache: bool = True, context_overflow: ContextOverflow = "error") -> GenerationOutput:
    """Beam search (any num_beams >= 1). A finished hypothesis with L generated tokens (its eos included)
    and summed log-probability S scores S / L**length_penalty; hypotheses still open after max_new_tokens
    are scored the same way with L = max_new_tokens. A batch row stops early only when no open beam can
    still beat its num_beams best finished ones (the bound is exact: log-probabilities only decrease), so
    with enough beams the result is the exhaustive optimum."""
    if num_beams < 1:
        raise ValueError(f"num_beams must be >= 1, got {num_beams}")
    if not 1 <= num_return_sequences <= num_beams:
        raise ValueError(f"num_return_sequences ({num_return_sequences}) must be between 1 and num_beams "
                         f"({num_beams})")
    K = num_beams
    s = _Setup(model, input_ids, max_new_tokens, attention_mask, eos_token_id, pad_token_id, context_overflow, K)
    B0 = s.B // K
    V = s.dec.vocab
    dev = s.buf.device
    eos = set(s.eos)
    cache = s.new_cache(use_cache)
    beam_scores = torch.zeros(B0, K, device=dev)
    beam_scores[:, 1:] = float("-inf")  # all beams start identical: expand only the first at step 1
    finished: list[list[tuple[float, Tensor]]] = [[] for _ in range(B0)]
    row_done = [False] * B0
    lp = length_penalty
    cur, inp = s.T, s.prompt
    for step in range(max_new_tokens):
        logits, _, cache = s.logits(cache, cur, inp, False)
        logp = torch.log_softmax(logits.float(), dim=-1)  # (B0*K, V)
        cand = (beam_scores.view(-1, 1) + logp).view(B0, K * V)
        top_s, top_i = cand.topk(min(2 * K, K * V), dim=1)  # 2K candidates: enough for K non-eos ones
        src_b, tok_b = (top_i // V).tolist(), (top_i % V).tolist()
        top_l = top_s.tolist()
        L = step + 1
        next_s = torch.full((B0, K), float("-inf"), device=dev)
        next_tok = torch.full((B0, K), s.pad, dtype=torch.long, device=dev)
        next_src = torch.zeros(B0, K, dtype=torch.long, device=dev)
        for b in range(B0):
            if row_done[b]:
                next_src[b] = torch.arange(K, device=dev)
                continue
            j = 0
            for r, (sc, src, tok) in enumerate(zip(top_l[b], src_b[b], tok_b[b])):
                if sc == float("-inf"):
                    break
                if tok in eos:
                    if r < K:  # an eos among the K best candidates closes a hypothesis
                        row = b * K + src
                        toks = torch.cat([s.buf[row, s.T:cur], torch.tensor([tok], device=dev)])
                        finished[b].append((sc / L**lp, toks))
                    continue
                next_s[b, j], next_tok[b, j], next_src[b, j] = sc, tok, src
                j += 1
                if j == K:
                    break
            finished[b] = sorted(finished[b], key=lambda h: -h[0])[:K]
            best_open = float(next_s[b, 0])
            if best_open == float("-inf"):
                row_done[b] = True
            elif len(finished[b]) >= K:
                # the best score any open beam can still reach: sum only decreases, so for lp > 0 the
                # longest length is the best one, for lp <= 0 the shortest (the next step)
                bound = best_open / (max_new_tokens**lp if lp > 0 else (L + 1) ** lp)
                if finished[b][-1][0] >= bound:
                    row_done[b] = True
        rows = (torch.arange(B0, device=dev).unsqueeze(1) * K + next_src).view(-1)
        s.buf = s.buf.index_select(0, rows)
        if cache is not None:
            cache.reorder(rows)
        s.buf[:, cur] = next_tok.view(-1)
        beam_scores = next_s
        cur += 1
        inp = s.buf[:, cur - 1 : cur]
        if all(row_done):
            break
    n_gen = cur - s.T
    for b in range(B0):  # open beams compete with the finished ones at their current length
        if row_done[b]:
            continue
        for k in range(K):
            sc = float(beam_scores[b, k])
            if sc != float("-inf") and n_gen > 0:
                finished[b].append((sc / n_gen**lp, s.buf[b * K + k, s.T:cur].clone()))
        finished[b] = sorted(finished[b], key=lambda h: -h[0])[:K]
    picked = [h for b in range(B0) for h in (finished[b][:num_return_sequences] or [(float("-inf"),
              torch.zeros(0, dtype=torch.long, device=dev))] * num_return_sequences)]
    width = max((len(t) for _, t in picked), default=0)
    gen = torch.full((len(picked), width), s.pad, dtype=torch.long, device=dev)
    for i, (_, t) in enumerate(picked):
        gen[i, : len(t)] = t
    scores = torch.tensor([sc for sc, _ in picked], device=dev)
    if s.seq2seq:
        seqs = gen
    else:
        prompts = s.prompt.view(B0, K, -1)[:, 0].repeat_interleave(num_return_sequences, 0)
        seqs = torch.cat([prompts, gen], dim=1)
    return GenerationOutput(sequences=seqs, scores=scores)


def _generator(generator: torch.Generator | None, seed: int | None, device: torch.device) -> torch.Generator | None:
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed, not both")
    if seed is not None:
        return torch.Generator(device=device).manual_seed(int(seed))
    return generator


def _check(do_sample: bool, num_beams: int, temperature: float, top_k: int | None, top_p: float | None,
           num_return_sequences: int) -> None:
    check_sampling_args(temperature, top_k, top_p)
    if num_beams < 1:
        raise ValueError(f"num_beams must be >= 1, got {num_beams}")
    if do_sample and num_beams > 1:
        raise ValueError("beam search is deterministic: use do_sample=True or num_beams > 1, not both")
    if num_return_sequences < 1:
        raise ValueError(f"num_return_sequences must be >= 1, got {num_return_sequences}")
    if num_beams == 1 and not do_sample and num_return_sequences > 1:
        raise ValueError("num_return_sequences > 1 needs do_sample=True or num_beams >= num_return_sequences")


class _EvalMode:
    """model.eval() for the duration, then the previous mode (dropout must be off while decoding)."""

    def __init__(self, model: Any) -> None:
        self.model, self.was = model, model.training

    def __enter__(self) -> None:
        self.model.eval()

    def __exit__(self, *exc: Any) -> None:
        self.model.train(self.was)


@torch.no_grad()
def generate(
    model: Any,
    input_ids: Tensor,
    max_new_tokens: int = 32,
    *,
    attention_mask: Tensor | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    num_return_sequences: int = 1,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    stop_strings: Sequence[str] | str | None = None,
    tokenizer: Any = None,
    stopping_criteria: StoppingCriteria | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    return_attentions: bool = False,
    return_dict: bool = False,
    context_overflow: ContextOverflow = "error",
) -> Tensor | GenerationOutput:
    """Generate up to max_new_tokens tokens per sequence.

    GPT: input_ids (B, T) prompts, LEFT-padded when of different lengths (attention_mask (B, T), 0 = pad);
    returns (B * num_return_sequences, T + new): the prompt followed by the continuation.
    Encoder-decoder: input_ids (B, S) is the source (any padding, attention_mask); the decoder starts from
    config.bos_token_id; returns (B * num_return_sequences, new) target ids without the start token.

    Decoding: greedy by default; do_sample=True samples from softmax(logits / temperature) after top_k and
    top_p filtering (temperature=0 means greedy); num_beams > 1 runs beam_search() with length_penalty
    (score = sum log p / L**length_penalty) and returns its num_return_sequences best. Sampling is
    deterministic given generator= or seed=.
    Stopping: a sequence stops at eos_token_id (default config.eos_token_id when the config has one; an int
    or a list), when its continuation decoded by `tokenizer` (an object with .decode(list[int]) -> str, or
    such a callable) contains one of stop_strings (the stop string's tokens are kept), or when
    stopping_criteria(sequences (B, T_so_far), new_tokens (B,)) returns True for it. After it stops, a row
    is filled with pad_token_id (default config.pad_token_id, else the eos id, else 0); the loop ends when
    every row has stopped.
    context_overflow: 'error' (default) raises a ValueError when prompt + max_new_tokens exceeds the
    context of a model with absolute positions (learned/sinusoidal; the encoder-decoder's target always);
    'slide' keeps going by recomputing (without cache) over the last context_length tokens.
    return_attentions=True (or return_dict=True) returns a GenerationOutput; its .attentions holds, per
    generated step, the per-layer attention weights (computed by the naive path).
    """
    _check(do_sample, num_beams, temperature, top_k, top_p, num_return_sequences)
    with _EvalMode(model):
        if num_beams > 1:
            if return_attentions:
                raise ValueError("return_attentions is not supported with beam search")
            if stop_strings or stopping_criteria is not None:
                raise ValueError("stop_strings / stopping_criteria are not supported with beam search")
            out = beam_search(model, input_ids, max_new_tokens, num_beams=num_beams, length_penalty=length_penalty,
                              num_return_sequences=num_return_sequences, attention_mask=attention_mask,
                              eos_token_id=eos_token_id, pad_token_id=pad_token_id, use_cache=use_cache,
                              context_overflow=context_overflow)
            return out if return_dict else out.sequences
        s = _Setup(model, input_ids, max_new_tokens, attention_mask, eos_token_id, pad_token_id,
                   context_overflow, num_return_sequences)
        stop = _stop_fn(stop_strings, tokenizer, stopping_criteria, s.T)
        attentions: list | None = [] if return_attentions else None
        n = 0
        for _ in _decode_loop(s, max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                              top_p=top_p, generator=_generator(generator, seed, input_ids.device),
                              use_cache=use_cache, stop=stop, return_attentions=return_attentions,
                              attentions=attentions):
            n += 1
        seqs = _result(s, n)
        if return_dict or return_attentions:
            return GenerationOutput(sequences=seqs, attentions=attentions or [])
        return seqs


def stream(
    model: Any,
    input_ids: Tensor,
    max_new_tokens: int = 32,
    *,
    attention_mask: Tensor | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    stop_strings: Sequence[str] | str | None = None,
    tokenizer: Any = None,
    stopping_criteria: StoppingCriteria | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    context_overflow: ContextOverflow = "error",
) -> Iterator[Tensor]:
    """Like generate() (greedy or sampling, no beams), but yields the (B,) LongTensor of new tokens as each
    step produces them (pad_token_id for rows that have already stopped). The tokens are exactly those
    generate() returns with the same arguments. Iterate it to the end, or close it, to restore the model's
    training mode."""
    _check(do_sample, 1, temperature, top_k, top_p, 1)
    # no_grad only around our own work: a context held across `yield` would leak into the caller's code
    with _EvalMode(model):
        with torch.no_grad():
            s = _Setup(model, input_ids, max_new_tokens, attention_mask, eos_token_id, pad_token_id,
                       context_overflow, 1)
        stop = _stop_fn(stop_strings, tokenizer, stopping_criteria, s.T)
        loop = _decode_loop(s, max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                            top_p=top_p, generator=_generator(generator, seed, input_ids.device),
                            use_cache=use_cache, stop=stop, return_attentions=False, attentions=None)
        while True:
            with torch.no_grad():
                try:
                    tok = next(loop)
                except StopIteration:
                    return
            yield tok


__all__ = ["GenerationOutput", "beam_search", "generate", "stream"]
