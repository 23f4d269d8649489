"""The decoding loops: greedy / sampling (one token per sequence per step) and beam search.

One implementation serves every model that implements the decoder protocol (qkv.models.decoding): GPT,
the encoder-decoders (EncoderDecoder, Whisper) and the LSTM. The loop never looks inside a model: it asks
`encode_source` once (an encoder-decoder encodes the source; everyone validates the ids that enter),
`prefill` for the prompt (or a recomputation without cache), and `step` for every further token, the fast
path over the cache. Settings come from one GenerationConfig (config.py), resolved as Hugging Face does:
the model's defaults, a passed config, then keyword overrides; what shapes the distribution is a list of
logits processors (processors.py).

Left padding. A batch of prompts of different lengths is padded on the left (attention_mask 0 there), so
every sequence's newest token is in the last column and one (B, 1) step serves all. The keys of the padding
are masked out, and each sequence gets its own position offset so that its first real token is position 0:
offset = -n_pad at prefill, then (cache length - n_pad). Positions below 0 are clamped inside positions()
and only ever belong to masked padding.

Hot path (one cached step): the next tokens are written into a preallocated (B, T + new) buffer, never
concatenated; the key mask is a slice of a preallocated buffer and is None when nothing is padded; the step
(Stack.step) writes the cache in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from qkv.generate.beams import BeamBook
from qkv.generate.config import GenerationConfig, resolve
from qkv.generate.graphed import GraphedSteps, cache_bucket, check_graphable, check_owner, static_cache
from qkv.generate.inputs import check_special_ids, left_padding, warn_past_trained_context
from qkv.generate.processors import Context, Pipeline
from qkv.generate.speculative import SpeculationStats, speculative_loop
from qkv.models.decoding import Decoder, as_decoder
from qkv.nn.cache import KVCache

# stopping_criteria(sequences (B, T_so_far), new_tokens (B,)) -> (B,) bool: True = this sequence stops now
StoppingCriteria = Callable[[Tensor, Tensor], Tensor]


@dataclass
class GenerationOutput:
    """What generate(..., return_dict=True) (or return_attentions=True) returns."""

    sequences: Tensor  # decoder-only: (N, T + new) prompt + continuation; encoder-decoder: (N, new)
    scores: Tensor | None = None  # beam search: (N,) length-penalised log-probability of each sequence
    # per generated step: the per-layer dicts {"self": (B, H, Tq, Tk), "cross": (B, H, Tq, S)}
    attentions: list[list[dict[str, Tensor]]] = field(default_factory=list)
    speculation: SpeculationStats | None = None  # speculative decoding: drafted and accepted tokens


def settings(model: Decoder, generation_config: GenerationConfig | int | None,
             options: dict[str, Any]) -> GenerationConfig:
    """The GenerationConfig of one call. An int in the config's place is max_new_tokens (the short form
    generate(model, ids, 50)); keyword options left at None change nothing (None = "the default")."""
    if isinstance(generation_config, int) and not isinstance(generation_config, bool):
        options = {"max_new_tokens": generation_config, **options}
        generation_config = None
    defaults = GenerationConfig()
    options = {k: v for k, v in options.items() if not (v is None and getattr(defaults, k, 0) is None)}
    return resolve(model.generation_defaults(), generation_config, options)


class _Run:
    """Everything both loops share: the resolved settings, the model, the prompt buffer and its mask."""

    def __init__(self, model: Decoder, input_ids: Tensor, cfg: GenerationConfig,
                 attention_mask: Tensor | None, expand: int) -> None:
        self.model, self.cfg = model, cfg
        self.seq2seq = model.is_seq2seq  # its input is the encoder's (ids, or audio for Whisper)
        if input_ids.dim() != 2 and not (self.seq2seq and input_ids.is_floating_point()):  # (audio: features)
            raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        if input_ids.shape[-1] == 0:
            raise ValueError("input_ids is empty: give at least one prompt token")
        # validates the ids where they enter (once per call; generated ids are in range by construction)
        self.source = model.encode_source(input_ids, attention_mask)
        self.eos = cfg.eos_ids
        check_special_ids(cfg, model.output_vocab_size)
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else (self.eos[0] if self.eos else 0)
        self.pad = int(pad)
        if self.seq2seq:
            start = cfg.decoder_start_token_id if cfg.decoder_start_token_id is not None else cfg.bos_token_id
            if start is None:
                raise ValueError("an encoder-decoder needs decoder_start_token_id (or bos_token_id) to start "
                                 "from")
            prompt = torch.full((input_ids.shape[0], 1), int(start), dtype=torch.long,
                                device=input_ids.device)
            n_pad = None
        else:
            prompt, n_pad = input_ids.long(), left_padding(attention_mask, input_ids.shape)
        if expand > 1:
            prompt = prompt.repeat_interleave(expand, 0)
            n_pad = None if n_pad is None else n_pad.repeat_interleave(expand, 0)
            if self.source is not None:
                self.source = self.source.repeat_interleave(expand)
        self.prompt, self.n_pad = prompt, n_pad
        self.B, self.T = prompt.shape
        self.max_new = max_new = cfg.new_tokens(self.T)
        self.total = self.T + max_new
        ctx = model.context_limit  # None: positions without a hard limit (RoPE, ALiBi, none, the LSTM)
        self.slide = False
        if ctx is not None and self.total > ctx:
            if cfg.context_overflow == "error":
                what = "1 start token" if self.seq2seq else f"prompt of {self.T} tokens"
                raise ValueError(
                    f"{what} + max_new_tokens={max_new} = {self.total} positions exceeds the model's "
                    f"context of {ctx}; shorten the prompt, lower max_new_tokens, or pass "
                    "context_overflow='slide' (qkv generate: --context-overflow slide) to recompute on the "
                    f"last {ctx} tokens")
            self.slide = True
        elif ctx is None and not self.seq2seq:
            warn_past_trained_context(model, self.T, max_new, self.total)
        self.ctx = ctx
        dev = prompt.device
        self.buf = torch.full((self.B, self.total), self.pad, dtype=torch.long, device=dev)
        self.buf[:, : self.T] = prompt
        self.keep = None
        if n_pad is not None:
            self.keep = torch.ones(self.B, self.total, dtype=torch.bool, device=dev)
            self.keep[:, : self.T] = torch.arange(self.T, device=dev).unsqueeze(0) >= n_pad.unsqueeze(1)
        self.eos_t = torch.tensor(self.eos, dtype=torch.long, device=dev) if self.eos else None
        self.graphed: GraphedSteps | None = None  # compile=True: the compiled steps, made at the first step
        if cfg.compile:
            check_graphable(model)

    def expand_rows(self, rows: Tensor) -> None:
        """Make row i the copy of row rows[i] in everything per row but the token buffer (beam search, after
        its first step on one row per input): the key mask, the left padding, the encoded source."""
        self.B = rows.numel()
        if self.keep is not None:
            self.keep = self.keep.index_select(0, rows)
        if self.n_pad is not None:
            self.n_pad = self.n_pad.index_select(0, rows)
        if self.source is not None:
            self.source = self.source.select_rows(rows)

    def pipeline(self, generator: torch.Generator | None, tokenizer: Any = None) -> Pipeline:
        """tokenizer: the caller's (a grammar's vocabulary, GenerationConfig.grammar)."""
        ctx = Context(self.T, self.max_new, self.eos, self.n_pad, tokenizer, self.model.output_vocab_size)
        return Pipeline(self.cfg, ctx, generator)

    def logits(self, cache: Any, cur: int, inp: Tensor,
               return_attentions: bool) -> tuple[Tensor, list | None, Any]:
        """Logits for the next position after buf[:, :cur]. Returns (logits, attentions, cache); the cache
        is dropped (None) once a sliding window takes over."""
        if cache is not None and cur > cache.max_len:
            cache = None  # the cache is full: from here on, recompute over the window
        if cache is not None:
            keep = None if self.keep is None else self.keep[:, :cur]
            offset = None if self.n_pad is None else cache.length - self.n_pad
            if cache.length > 0 and not return_attentions:  # the fast decoding step
                if self.cfg.compile and inp.shape[1] == 1:
                    check_owner(cache, self)
                    if self.graphed is None or self.graphed.cache is not cache:
                        self.graphed = GraphedSteps(self.model, self.cfg.compile, cache, self.n_pad,
                                                    self.keep)
                    return self.graphed(inp), None, cache
                return self.model.step(inp, cache, keep=keep, offset=offset), None, cache
            logits, att = self.model.prefill(inp, cache, keep=keep, offset=offset, source=self.source,
                                             return_attentions=return_attentions)
            return logits, att, cache
        lo = max(0, cur - self.ctx) if (self.slide and self.ctx is not None) else 0
        keep = None if self.keep is None else self.keep[:, lo:cur]
        offset = None
        if self.n_pad is not None:  # the first real token of each row is position 0 of the window
            offset = -(self.n_pad - lo).clamp_min(0)
        logits, att = self.model.prefill(self.buf[:, lo:cur], None, keep=keep, offset=offset,
                                         source=self.source, return_attentions=return_attentions)
        return logits, att, None

    def new_cache(self) -> Any:
        if not self.cfg.use_cache:
            return None
        size = self.total if not self.slide else self.ctx
        # one compiled graph, one recorded CUDA graph, for many lengths
        if self.cfg.compile and not self.slide:
            return static_cache(self.model, self.B, cache_bucket(size, self.ctx), self)
        return self.model.make_cache(self.B, size)


def _stop_fn(stop_strings: Sequence[str] | None, tokenizer: Any, stopping_criteria: StoppingCriteria | None,
             start: int) -> StoppingCriteria | None:
    """Combine stop strings (decoded with tokenizer.decode, or a callable ids -> str) and a user criterion."""
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer (an object with .decode(ids) or a callable ids -> "
                         "str)")
    if not stop_strings and stopping_criteria is None:
        return None
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


def _decode_loop(s: _Run, pipe: Pipeline, stop: StoppingCriteria | None, return_attentions: bool,
                 attentions: list | None) -> Iterator[Tensor]:
    """Greedy or sampled decoding; yields the (B,) new tokens of each step (pad for finished rows) and
    writes them into s.buf."""
    cache = s.new_cache()
    per_row = s.eos_t is not None or stop is not None
    done = torch.zeros(s.B, dtype=torch.bool, device=s.buf.device) if per_row else None
    cur, inp = s.T, s.prompt
    for _ in range(s.max_new):
        logits, att, cache = s.logits(cache, cur, inp, return_attentions)
        if attentions is not None:
            attentions.append(att)
        nxt = pipe.choose(s.buf[:, :cur], logits)
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


def _result(s: _Run, n: int) -> Tensor:
    out = s.buf[:, : s.T + n]
    return out[:, 1:] if s.seq2seq else out


def _generator(generator: torch.Generator | None, seed: int | None,
               device: torch.device) -> torch.Generator | None:
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed, not both")
    if seed is not None:
        return torch.Generator(device=device).manual_seed(int(seed))
    return generator


class _EvalMode:
    """model.eval() for the duration, then the previous mode (dropout must be off while decoding)."""

    def __init__(self, model: Any) -> None:
        self.model, self.was = model, model.training

    def __enter__(self) -> None:
        self.model.eval()

    def __exit__(self, *exc: Any) -> None:
        self.model.train(self.was)


# _row_topk: the block width of the two-stage top-k, and the row length from which it is used (shorter rows go
# to
# torch.topk directly)
TOPK_BLOCK = 128
TOPK_TWO_STAGE_MIN = 8192


def _row_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """x.topk(k, dim=1) of a (rows, V) matrix (values sorted, best first), in two stages for a long row: the
    maximum of every block of TOPK_BLOCK entries (one vectorised pass), the k blocks with the largest maxima,
    then the top k of those k blocks' entries (and the tail past the last full block). Exact: an entry among
    a row's k best lies in a block whose maximum is among the k largest block maxima (k other blocks with
    larger maxima would hold k entries larger than it). Only the order among EQUAL values may differ from
    torch.topk's, which torch leaves unspecified as well. torch.topk over a (64 x 58101) beam-search score
    matrix copies every row into (value, index) pairs and took ~10x the two-stage time on the AVX2 machine."""
    R, V = x.shape
    c = TOPK_BLOCK
    n = V // c
    if V < TOPK_TWO_STAGE_MIN or n < k or not x.is_contiguous():
        return x.topk(k, dim=1)
    best_blocks = x[:, : n * c].view(R, n, c).amax(dim=2).topk(k, dim=1).indices  # (R, k)
    idx = (best_blocks.unsqueeze(2) * c + torch.arange(c, device=x.device)).view(R, k * c)
    if n * c < V:
        idx = torch.cat([idx, torch.arange(n * c, V, device=x.device).expand(R, V - n * c)], dim=1)
    s, j = x.gather(1, idx).topk(k, dim=1)
    return s, idx.gather(1, j)


@torch.no_grad()
def beam_search(model: Any, input_ids: Tensor, generation_config: GenerationConfig | int | None = None, *,
                attention_mask: Tensor | None = None, **options: Any) -> GenerationOutput:
    """Beam search (any num_beams >= 1; 4 unless the config or options say otherwise). A finished
    hypothesis with L generated tokens (its eos included) and summed log-probability S scores
    S / L**length_penalty; hypotheses still open after max_new_tokens are scored the same way with
    L = max_new_tokens. The logits processors (no_repeat_ngram_size, min length, forced BOS/EOS, repetition
    penalty) act on the log-probabilities, as in Hugging Face. A batch row stops early:
      early_stopping="never" (default)  when no open beam can still beat its num_beams best finished ones
                                         (the bound is exact: log-probabilities only decrease, so with enough
                                         beams the result is the exhaustive optimum);
      early_stopping=True               as soon as num_beams hypotheses are finished;
      early_stopping=False              Hugging Face's heuristic: the best open beam, scored at its current
                                         length, cannot beat the worst finished one."""
    dec = as_decoder(model)
    cfg = settings(dec, generation_config, options)
    if cfg.num_beams == 1 and "num_beams" not in options:  # neither the call, its config nor the model asks
        cfg = cfg.replace(num_beams=4)
    with _EvalMode(model):
        return _beam_search(dec, input_ids, cfg, attention_mask)


def _beam_search(model: Decoder, input_ids: Tensor, cfg: GenerationConfig,
                 attention_mask: Tensor | None) -> GenerationOutput:
    K = cfg.num_beams
    # The first step runs on one row per input (B0 rows): all K beams of an input start identical, so the
    # prompt (an encoder-decoder's cross-attention K/V too) is computed once, not K times; its candidates
    # come from that one row (as they did from beam 0 of K, the others scored -inf). Then every row is
    # repeated K times (the buffers, the mask and the cache: cache.reorder to the new batch size).
    s = _Run(model, input_ids, cfg, attention_mask, 1)
    pipe = s.pipeline(None)
    B0, dev = s.B, s.buf.device
    book = BeamBook(B0, cfg, s.max_new, set(s.eos), s.pad)
    cache = s.new_cache()
    beam_scores = torch.zeros(B0, 1, device=dev)
    cur, inp = s.T, s.prompt
    logp_buf: Tensor | None = None  # the (rows, V) log-probabilities, written in place every step
    for step in range(s.max_new):
        Kc = beam_scores.shape[1]  # beams per input this step: 1 at the first, then K
        if step == s.max_new - 1 and pipe.forces(cur):
            # the last step's token is forced (forced_eos_token_id at max_length): the processors ignore the
            # logits and nothing reads the cache afterwards, so the model is not run
            logits = torch.zeros(s.B, model.output_vocab_size, device=dev)
        else:
            logits, _, cache = s.logits(cache, cur, inp, False)
        logits = logits.float()
        if logp_buf is None or logp_buf.shape != logits.shape:
            logp_buf = torch.empty_like(logits)
        logp = torch.log_softmax(logits, dim=-1, out=logp_buf)
        logp = pipe.process(s.buf[:, :cur], logp, inplace=True)  # (B0*Kc, V)
        top, src, tok = _candidates(logp, beam_scores, max(2, 1 + len(s.eos)) * K)
        beams = book.advance(top, src, tok, Kc, s.buf[:, s.T:cur], step + 1)
        rows = (torch.arange(B0, device=dev).unsqueeze(1) * Kc + beams.sources).view(-1)
        s.buf = s.buf.index_select(0, rows)
        if Kc != K:  # after the first step: every input's row becomes its K beams
            s.expand_rows(rows)
            pipe = s.pipeline(None)
        _reorder(cache, rows, s.seq2seq)
        s.buf[:, cur] = beams.tokens.view(-1)
        beam_scores = beams.scores
        cur += 1
        inp = s.buf[:, cur - 1 : cur]
        if all(book.done):
            break
    book.close(beam_scores, s.buf[:, s.T:cur])
    gen, scores = book.best(dev)
    if s.seq2seq:
        return GenerationOutput(sequences=gen, scores=scores)
    prompts = s.prompt.repeat_interleave(cfg.num_return_sequences, 0)  # each input's prompt (never expanded)
    return GenerationOutput(sequences=torch.cat([prompts, gen], dim=1), scores=scores)


def _candidates(logp: Tensor, beam_scores: Tensor,
                width: int) -> tuple[list[list[float]], list[list[int]], list[list[int]]]:
    """Each input's `width` best continuations over its Kc beams, best first: (summed log-probabilities,
    beam, token) as lists. `width` = 2K candidates per input (enough for K non-eos ones), (1 + number of
    eos ids) * K with several eos ids, as Hugging Face keeps, so that eos candidates, which finish
    hypotheses, can never crowd out the K open ones.

    The best `width` of each beam's row, then the best `width` of those Kc * width: the same set as one
    top-k over the (B0, Kc * V) scores (5.7 vs 9.1 ms at 64 x 58k, 1 thread). The beam's score is added
    to its row's candidates only, not to all V log-probabilities: a constant per row never changes which
    entries of the row are best, and each candidate's sum is the same float addition as adding to every
    entry first, with one pass over the (rows, V) scores fewer."""
    B0, Kc = beam_scores.shape
    kr = min(width, logp.shape[-1])
    row_s, row_i = _row_topk(logp, kr)
    row_s += beam_scores.view(-1, 1)
    top_s, j = row_s.view(B0, Kc * kr).topk(min(width, Kc * kr), dim=1)
    return top_s.tolist(), (j // kr).tolist(), row_i.view(B0, Kc * kr).gather(1, j).tolist()


def _reorder(cache: Any, rows: Tensor, seq2seq: bool) -> None:
    """Move the cache's rows to follow the beams (`rows`: the previous row of each new one)."""
    if cache is None:
        return
    if seq2seq and isinstance(cache, KVCache):
        # every beam of a sentence reads the same encoder K/V: only the self-attention cache moves, and
        # the encoder's K/V stay at one row per sentence (the attention step shares them among its beams)
        cache.reorder(rows, cross=False)
    else:
        cache.reorder(rows)


def _speculating(cfg: GenerationConfig, assistant_model: Any) -> bool:
    """Whether this call decodes speculatively (a clear error for settings it cannot serve)."""
    if assistant_model is None and not cfg.prompt_lookup_num_tokens:
        return False
    if assistant_model is not None and cfg.prompt_lookup_num_tokens:
        raise ValueError("speculative decoding: pass assistant_model or prompt_lookup_num_tokens, not both")
    if cfg.grammar is not None:
        raise ValueError("speculative decoding does not follow a grammar: drop the grammar or the drafts")
    if cfg.num_beams > 1 or cfg.compile:
        raise ValueError("speculative decoding runs greedy or sampled decoding, eagerly: not with beam "
                         "search (num_beams > 1) or compile")
    return True


@torch.no_grad()
def generate(model: Any, input_ids: Tensor, generation_config: GenerationConfig | int | None = None, *,
             attention_mask: Tensor | None = None, tokenizer: Any = None,
             stopping_criteria: StoppingCriteria | None = None, generator: torch.Generator | None = None,
             return_attentions: bool = False, return_dict: bool = False, assistant_model: Any = None,
             **options: Any) -> Tensor | GenerationOutput:
    """Generate up to max_new_tokens tokens per sequence.

    Settings: a GenerationConfig (`generation_config`, or an int = max_new_tokens) and/or its fields as
    keywords, Hugging Face style: generate(model, ids, max_new_tokens=50, do_sample=True, top_p=0.9).
    Token ids left unset come from the model (model.generation_defaults()).

    Decoder-only: input_ids (B, T) prompts, LEFT-padded when of different lengths (attention_mask (B, T),
    0 = pad); returns (B * num_return_sequences, T + new): the prompt followed by the continuation.
    Encoder-decoder: input_ids (B, S) is the source (any padding, attention_mask; audio for Whisper); the
    decoder starts from decoder_start_token_id (default bos_token_id); returns (B * num_return_sequences,
    new) target ids without the start token.

    Decoding: greedy by default; do_sample=True samples from softmax(logits / temperature) after top_k,
    top_p and min_p (temperature=0 means greedy); num_beams > 1 runs beam_search() and returns its
    num_return_sequences best. repetition_penalty, no_repeat_ngram_size, min_new_tokens / min_length and
    forced_bos / forced_eos_token_id apply to every strategy. Sampling is deterministic given generator= or
    the config's seed.
    Stopping: a sequence stops at eos_token_id (an int or a list), when its continuation decoded by
    `tokenizer` (an object with .decode(list[int]) -> str, or such a callable) contains one of stop_strings
    (the stop string's tokens are kept), or when stopping_criteria(sequences (B, T_so_far), new_tokens (B,))
    returns True for it. After it stops, a row is filled with pad_token_id (default the model's, else the
    eos id, else 0); the loop ends when every row has stopped.
    context_overflow: 'error' (default) raises a ValueError when prompt + max_new_tokens exceeds the
    context of a model with absolute positions (learned/sinusoidal); 'slide' keeps going by recomputing
    (without cache) over the last context_length tokens.
    return_attentions=True (or return_dict=True) returns a GenerationOutput; its .attentions holds, per
    generated step, the per-layer attention weights (computed by the full forward pass).
    Speculative decoding (speculative.py; one sequence, decoder-only): prompt_lookup_num_tokens=N drafts N
    tokens by n-gram lookup in the text so far, assistant_model=a small model of the same tokenizer drafts
    num_assistant_tokens; the target checks them in one forward. The tokens are plain greedy's, or
    distributed as plain sampling's; GenerationOutput.speculation counts the accepted drafts.
    """
    dec = as_decoder(model)
    cfg = settings(dec, generation_config, options)
    if _speculating(cfg, assistant_model):
        with _EvalMode(model), _EvalMode(assistant_model or model):
            if return_attentions:
                raise ValueError("return_attentions is not supported with speculative decoding")
            s = _Run(dec, input_ids, cfg, attention_mask, cfg.num_return_sequences)
            stats = SpeculationStats()
            loop = speculative_loop(s, _stop_fn(cfg.stop_strings, tokenizer, stopping_criteria, s.T),
                                    generator=_generator(generator, cfg.seed, input_ids.device),
                                    assistant_model=assistant_model, stats=stats)
            seqs = _result(s, sum(1 for _ in loop))
            return GenerationOutput(sequences=seqs, speculation=stats) if return_dict else seqs
    with _EvalMode(model):
        if cfg.num_beams > 1:
            if return_attentions:
                raise ValueError("return_attentions is not supported with beam search")
            if cfg.stop_strings or stopping_criteria is not None:
                raise ValueError("stop_strings / stopping_criteria are not supported with beam search")
            out = _beam_search(dec, input_ids, cfg, attention_mask)
            return out if return_dict else out.sequences
        if return_attentions and cfg.compile:
            raise ValueError("return_attentions needs the full forward at every step: use compile=False")
        s = _Run(dec, input_ids, cfg, attention_mask, cfg.num_return_sequences)
        stop = _stop_fn(cfg.stop_strings, tokenizer, stopping_criteria, s.T)
        pipe = s.pipeline(_generator(generator, cfg.seed, input_ids.device), tokenizer)
        attentions: list | None = [] if return_attentions else None
        n = sum(1 for _ in _decode_loop(s, pipe, stop, return_attentions, attentions))
        seqs = _result(s, n)
        if return_dict or return_attentions:
            return GenerationOutput(sequences=seqs, attentions=attentions or [])
        return seqs


def stream(model: Any, input_ids: Tensor, generation_config: GenerationConfig | int | None = None, *,
           attention_mask: Tensor | None = None, tokenizer: Any = None,
           stopping_criteria: StoppingCriteria | None = None, generator: torch.Generator | None = None,
           assistant_model: Any = None, **options: Any) -> Iterator[Tensor]:
    """Like generate() (greedy or sampling; num_beams must be 1), but yields the (B,) LongTensor of new
    tokens as each step produces them (pad_token_id for rows that have already stopped). The tokens are
    exactly those generate() returns with the same settings. Iterate it to the end, or close it, to restore
    the model's training mode."""
    dec = as_decoder(model)
    cfg = settings(dec, generation_config, options)
    if cfg.num_beams > 1 or cfg.num_return_sequences > 1:
        raise ValueError("stream() yields one sequence per input token by token: beam search and "
                         "num_return_sequences > 1 need generate()")
    # no_grad only around our own work: a context held across `yield` would leak into the caller's code
    with _EvalMode(model), _EvalMode(assistant_model or model):
        with torch.no_grad():
            s = _Run(dec, input_ids, cfg, attention_mask, 1)
        stop = _stop_fn(cfg.stop_strings, tokenizer, stopping_criteria, s.T)
        gen = _generator(generator, cfg.seed, input_ids.device)
        if _speculating(cfg, assistant_model):
            loop = speculative_loop(s, stop, generator=gen, assistant_model=assistant_model,
                                    stats=SpeculationStats())
        else:
            loop = _decode_loop(s, s.pipeline(gen, tokenizer), stop, False, None)
        while True:
            with torch.no_grad():
                try:
                    tok = next(loop)
                except StopIteration:
                    return
            yield tok


__all__ = ["GenerationOutput", "beam_search", "generate", "settings", "stream"]
