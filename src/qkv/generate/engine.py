"""Continuous batching over a paged KV cache, for decoder-only models (the decoder protocol).

    engine = Engine(model, block_size=16, max_batch_size=32)            # + engine-wide generation settings
    ids = [engine.add_request(prompt, max_new_tokens=64) for prompt in prompts]
    ids.append(engine.add_request(prompt, GenerationConfig(do_sample=True, top_p=0.9, seed=1)))  # per request
    outputs = engine.run()                      # {request id: [new token ids]}
    # or step by step: engine.step() -> [(request id, token), ...]; add_request / cancel between steps

A request is its token sequence S = prompt + the tokens produced so far, and `computed`, how many of S have
their keys/values in the cache. One step (the scheduler, in this order):

1. Admit waiting requests, first-come first-served with preempted requests ahead of never-started ones,
   while the batch has room and the free blocks hold the request's uncached prompt (plus a small watermark
   while others run). Blocks are NOT reserved for the worst case: they are taken when written.
   Prefix cache: the leading full blocks of S that some earlier sequence already computed (same tokens from
   position 0: BlockAllocator's content hashes) are shared instead of computed (a fully cached prompt still
   recomputes its last token, into a copy of the shared last block: copy-on-write). A request whose first
   block is being prefilled by a running request waits for it, so a burst of requests with one system
   prompt computes it once.
2. Chunked prefill: requests with more than one token to feed share a budget of `prefill_chunk` tokens a
   step (default 1024; in admission order, the oldest prompt first), so a long prompt is spread over several
   steps and every running request still gets a token each step. Pieces of equal length go through one
   forward (B rows of T tokens, per-row offsets and key mask): short prompts, and the last pieces of long
   ones, do not cost a forward each. A request whose prompt is done emits its first token.
   prefill_chunk=None feeds whole prompts at once. The budget trades throughput against the longest gap
   between two tokens of a running request: 1024 tokens made the 64-request load of benchmarks/serve.py
   ~5-10% faster than 256 (shorter ramp, fewer steps at small batch) for a gap of about one 1024-token
   forward (docs/serving.md).
3. One batched decoding step (model.step on the paged cache, per-row offsets and key mask) for every other
   running request; when their cached lengths differ widely the batch is cut into up to four groups of
   similar length, one forward each (_length_groups: each forward gathers and attends over its rows padded
   to its own longest sequence, not the batch's).

Preemption by recomputation (vLLM's default): when a write needs a block and none is free (cached,
unreferenced prefix blocks count as free and are evicted least-recently-used first), a victim's blocks are
freed and it goes back to the head of the waiting queue with its S; when re-admitted it is prefilled from
S (its full blocks often still in the prefix cache). Victims: `preemption="least_work"` (default) takes the
running request with the fewest computed tokens (the cheapest to recompute), "newest" (vLLM's order) the latest
arrival. On benchmarks/serve.py's load with a third of the blocks it needs, least_work threw away 26.7k computed
tokens against newest's 35.5k, and finished sooner in both quiet passes (docs/serving.md). Greedy outputs
do not change: the recomputed keys/values are those of the same tokens.

Settings: the engine's GenerationConfig (model defaults, then the config and keywords given to Engine) is
every request's base; a request may bring its own config and keywords on top (max_new_tokens, temperature,
top_k, top_p, eos_token_id, stop_strings, seed, ...). Greedy requests without sequence-dependent processors
share one argmax; the others go through their own logits processors (and, with a seed, their own random
generator, so a seeded request draws the same tokens whatever else is in the batch).
Stop strings need `tokenizer` (an object with .decode(ids) or a callable ids -> str); they are looked for in the
output's last tokens decoded after the few tokens before them (the prompt's tail at first: _hits_stop).
"""

from __future__ import annotations

import numbers
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from qkv.generate.config import GenerationConfig
from qkv.generate.processors import Context, Pipeline
from qkv.generate.search import settings
from qkv.generate.text import decode_continuation
from qkv.models.decoding import as_decoder, configured_context
from qkv.nn.checks import check_id_list
from qkv.nn.paged import block_digest

PREEMPTION = ("least_work", "newest")
# tokens decoded before a text and never part of it (vLLM's initial detokenization offset): a SentencePiece-style
# (Metaspace) decoder drops the leading space of a text's first token, which a continuation of a prompt keeps
TEXT_CONTEXT = 5


@dataclass(eq=False)  # identity: `req in self.running` must not compare every field
class _Request:
    id: int
    prompt: list[int]
    cfg: GenerationConfig
    max_new_tokens: int
    eos: set[int]
    pipe: Pipeline
    stop: list[str]
    output: list[int] = field(default_factory=list)
    computed: int = 0  # tokens of prompt + output whose keys/values are in the cache
    digests: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks, in order
    preemptions: int = 0
    head: bytes = b""  # prefix-cache key of its first block (b"": shorter than a block)
    stop_window: int = 0  # output tokens decoded to look for a stop string (_hits_stop)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class Counters:
    """Cumulative engine counters (the server's /metrics)."""

    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    generated_tokens: int = 0
    prefill_tokens: int = 0  # tokens fed by prefill chunks (computed, not found in the prefix cache)
    prefix_query_tokens: int = 0  # tokens looked up in the prefix cache at admission
    prefix_hit_tokens: int = 0  # ... and found there
    preemptions: int = 0
    recomputed_tokens: int = 0  # computed tokens thrown away by preemption
    finished: int = 0
    cancelled: int = 0
    steps: int = 0


class Engine:
    def __init__(
        self,
        model: Any,
        generation_config: GenerationConfig | None = None,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_batch_size: int = 32,
        prefill_chunk: int | None = 1024,
        prefix_caching: bool = True,
        preemption: str = "least_work",
        tokenizer: Any = None,
        split_cost: int | None | str = "auto",
        max_model_len: int | None = None,
        **options: Any,
    ) -> None:
        dec = as_decoder(model)
        if dec.is_seq2seq:
            raise ValueError("Engine serves decoder-only models; use generate() for encoder-decoders")
        if preemption not in PREEMPTION:
            raise ValueError(f"preemption must be one of {PREEMPTION}, got {preemption!r}")
        for name, value in (("block_size", block_size), ("max_batch_size", max_batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if num_blocks is not None and (not isinstance(num_blocks, int) or num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive integer (or None: max_batch_size sequences of the context), got {num_blocks!r}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 (or None: whole prompts), got {prefill_chunk}")
        self.model = dec
        model.eval()
        self.cfg = settings(dec, generation_config, options)
        self.decode_text: Callable[[list[int]], str] | None = (
            None if tokenizer is None else tokenizer.decode if hasattr(tokenizer, "decode") else tokenizer)
        self._check(self.cfg)
        # the longest prompt + output a request may ask for (checked before it takes blocks): by default the model's
        # context, for RoPE / ALiBi models the context they were configured for (as vLLM's max_model_len)
        self.context = configured_context(dec)
        if max_model_len is not None:
            if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
                raise ValueError(f"max_model_len must be a positive integer (or None: the model's), got "
                                 f"{max_model_len!r}")
            if dec.context_limit is not None and max_model_len > dec.context_limit:
                raise ValueError(f"max_model_len={max_model_len} exceeds the model's context of "
                                 f"{dec.context_limit} positions (its position table ends there)")
            self.context = max_model_len
        self.cache = dec.make_paged_cache(num_blocks, block_size, max_batch_size=max_batch_size)
        self.device = self.cache.device
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        self.prefix_caching = prefix_caching
        self.preemption = preemption
        self.watermark = max(1, self.cache.allocator.num_blocks // 100)
        if split_cost == "auto":  # the split saves padding traffic, which only a step that gathers K/V has
            split_cost = None if self.cache.step_reads_in_place else 4096
        elif isinstance(split_cost, str):
            raise ValueError(f"split_cost must be an int, None or 'auto', got {split_cost!r}")
        self.split_cost, self.split_depth = split_cost, 2  # see _length_groups
        seed = self.cfg.seed
        self.generator = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.finished: dict[int, list[int]] = {}
        self.finish_reason: dict[int, str] = {}  # "stop" (eos / stop string), "length", "cancelled", "error"
        self.errors: dict[int, str] = {}  # why a request finished with "error" (until pop_finished)
        self.just_finished: list[int] = []  # ids finished or cancelled since the last take_finished()
        self.counters = Counters()
        self._next_id = 0
        self.peak_blocks = 0

    @property
    def steps(self) -> int:
        return self.counters.steps

    def _check(self, cfg: GenerationConfig) -> None:
        if cfg.num_beams > 1 or cfg.num_return_sequences > 1:
            raise ValueError("the Engine decodes one sequence per request: num_beams and num_return_sequences must be 1")
        if cfg.stop_strings and self.decode_text is None:
            raise ValueError("stop_strings need the Engine's tokenizer= (to decode the tokens)")

    # -- requests ---------------------------------------------------------------------------------------
    def room(self, prompt_len: int) -> int:
        """The most new tokens a prompt of this length can ask for: what the context and the whole KV pool leave
        (the last new token is never written to the cache). < 1: the prompt alone does not fit."""
        pool = self.cache.allocator.num_blocks * self.cache.block_size - prompt_len + 1
        return pool if self.context is None else min(pool, self.context - prompt_len)

    def check_request(self, prompt_len: int, max_new: int) -> None:
        """ValueError when a request of this size can never run (over the context, or the whole pool)."""
        if self.context is not None and prompt_len + max_new > self.context:
            raise ValueError(f"prompt of {prompt_len} tokens + max_new_tokens={max_new} exceeds the "
                             f"model's context of {self.context} positions")
        need = -(-(prompt_len + max(max_new - 1, 0)) // self.cache.block_size)
        if need > self.cache.allocator.num_blocks:
            raise ValueError(f"the request needs {need} blocks but the pool has only "
                             f"{self.cache.allocator.num_blocks}")

    def add_request(self, prompt: Sequence[int] | Tensor, generation_config: GenerationConfig | int | None = None,
                    **options: Any) -> int:
        """Queue a prompt (1-D ids) with this request's settings on top of the engine's (a GenerationConfig,
        or an int = max_new_tokens, and/or keywords); returns the request id used by step(), run(), cancel()."""
        if isinstance(prompt, Tensor):
            if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool or prompt.dim() != 1:
                raise TypeError(f"a prompt tensor must be 1-D integer token ids, got {prompt.dtype} of shape "
                                f"{tuple(prompt.shape)}")
            prompt = prompt.tolist()
        bad = next((t for t in prompt if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
        if bad is not None:  # 1.7 would become token 1 without a word
            raise TypeError(f"a prompt is a list of int token ids, got {type(bad).__name__} {bad!r}")
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("a request needs at least one prompt token")
        check_id_list(ids, self.model.output_vocab_size)  # the one check, where the ids enter
        if isinstance(generation_config, int) and not isinstance(generation_config, bool):
            options = {"max_new_tokens": generation_config, **options}
            generation_config = None
        own = dict(generation_config.explicit()) if generation_config is not None else {}
        own.update({k: v for k, v in options.items() if v is not None})
        cfg = self.cfg.replace(**own) if own else self.cfg
        self._check(cfg)
        max_new = cfg.new_tokens(len(ids))
        self.check_request(len(ids), max_new)
        generator = self.generator
        if "seed" in own and cfg.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        pipe = Pipeline(cfg, Context(len(ids), max_new, cfg.eos_ids), generator)
        rid = self._next_id
        self._next_id += 1
        req = _Request(rid, ids, cfg, max_new, set(cfg.eos_ids), pipe, list(cfg.stop_strings or []))
        # a stop string of c characters lies in the text of its last 4c tokens at most (a character is at most 4
        # bytes, a byte-level or byte-fallback token at least 1), + 1 to spare
        req.stop_window = 4 * max((len(s) for s in req.stop), default=0) + 1
        if len(ids) >= self.cache.block_size:
            req.head = block_digest(b"", ids[:self.cache.block_size])
        if max_new == 0:  # done at once, but reported like any other end (take_finished, the counters)
            self.finished[rid], self.finish_reason[rid] = [], "length"
            self.counters.finished += 1
            self.just_finished.append(rid)
        else:
            self.waiting.append(req)
        return rid

    def cancel(self, request_id: int) -> bool:
        """Drop a waiting or running request and free every block it holds; False if it is not queued."""
        for req in self.waiting:
            if req.id == request_id:
                self.waiting.remove(req)
                break
        else:
            for req in self.running:
                if req.id == request_id:
                    self.running.remove(req)
                    self.cache.free_sequence(req.id)
                    break
            else:
                return False
        self.finished[req.id], self.finish_reason[req.id] = req.output, "cancelled"
        self.counters.cancelled += 1
        self.just_finished.append(req.id)
        return True

    def pop_finished(self, request_id: int) -> tuple[list[int], str] | None:
        """(tokens, finish reason) of a finished request, forgotten by the engine (a server's memory bound)."""
        if request_id not in self.finished:
            return None
        self.errors.pop(request_id, None)
        return self.finished.pop(request_id), self.finish_reason.pop(request_id)

    def take_finished(self) -> list[int]:
        """The requests finished or cancelled since the last call (a server's signal to close streams)."""
        done, self.just_finished = self.just_finished, []
        return done

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict[str, Any]:
        a = self.cache.allocator
        c = self.counters
        return {
            "running": len(self.running), "waiting": len(self.waiting),
            "preempted_waiting": sum(1 for r in self.waiting if r.preemptions), "preemptions": c.preemptions,
            "blocks_total": a.num_blocks, "blocks_used": a.num_used, "blocks_cached": a.num_cached,
            "blocks_free": a.num_free, "evictions": a.evictions, "cow_copies": self.cache.copies,
            "prefix_hit_rate": c.prefix_hit_tokens / c.prefix_query_tokens if c.prefix_query_tokens else 0.0,
            "prompt_tokens": c.prompt_tokens, "generated_tokens": c.generated_tokens,
            "prefill_tokens": c.prefill_tokens, "prefix_hit_tokens": c.prefix_hit_tokens,
            "recomputed_tokens": c.recomputed_tokens, "finished": c.finished, "cancelled": c.cancelled,
            "steps": c.steps,
        }

    # -- token choice -----------------------------------------------------------------------------------
    def _choose(self, reqs: list[_Request], logits: Tensor) -> list[int | None]:
        """Each request's next token from its row of logits, through its own settings. Plain greedy rows
        share one argmax; rows sharing a settings object with no sequence-dependent processor one draw.
        None: that request's own settings broke its token choice (self.errors says how); the others go on."""
        out: list[int | None] = [0] * len(reqs)
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(reqs):
            p = r.pipe
            key = -1 if not (p.processors or p.sampling) else id(r.cfg) if not p.processors else -2 - i
            groups.setdefault(key, []).append(i)
        for key, rows in groups.items():
            sub = logits if len(rows) == len(reqs) else logits[rows]
            if key == -1:
                toks = sub.argmax(-1).tolist()
            else:
                r = reqs[rows[0]]
                ids = torch.tensor([r.tokens], dtype=torch.long, device=self.device) if r.pipe.processors else None
                try:
                    toks = r.pipe.choose(ids, sub).tolist()
                except RuntimeError as e:
                    # settings that turn this request's scores non-finite (a repetition_penalty of 1e-300 divides
                    # them into inf, softmax makes NaN, torch.multinomial refuses them) fail this request only:
                    # raised here, they stopped the whole engine and every other request with it
                    for i in rows:
                        out[i] = None
                        self.errors[reqs[i].id] = f"sampling failed for this request's settings: {e}"
                    continue
            for i, t in zip(rows, toks):
                out[i] = t
        return out

    def _emit(self, req: _Request, tok: int | None, events: list[tuple[int, int]]) -> bool:
        """Record a token; True when the request is finished (and then it has left the engine). tok None: its
        token choice failed (_choose): it finishes with "error"."""
        if tok is None:
            reason: str | None = "error"
        else:
            req.output.append(tok)
            events.append((req.id, tok))
            self.counters.generated_tokens += 1
            reason = None
            if tok in req.eos:
                reason = "stop"
            elif req.stop and self._hits_stop(req):
                reason = "stop"
            elif len(req.output) >= req.max_new_tokens:
                reason = "length"
        if reason is None:
            return False
        self.cache.free_sequence(req.id)
        self.running.remove(req)
        self.finished[req.id], self.finish_reason[req.id] = req.output, reason
        self.counters.finished += 1
        self.just_finished.append(req.id)
        return True

    def _hits_stop(self, req: _Request) -> bool:
        """Whether req's output text now contains one of its stop strings. The text is decoded after the
        TEXT_CONTEXT tokens before it (the prompt's last ones at first), as a server decodes what it sends
        (serve/app.py, TextStream): decoded alone, a SentencePiece-style output lost its first leading space, so
        a stop string " he" at the very start was cut from the server's text but never stopped the request
        (finish "length", every token generated). And only the last stop_window tokens: decoding the whole
        output on every token cost O(length) a token."""
        out, start = req.output, max(0, len(req.output) - req.stop_window)
        if start >= TEXT_CONTEXT:
            context = out[start - TEXT_CONTEXT:start]
        else:
            context = req.prompt[len(req.prompt) - (TEXT_CONTEXT - start):] + out[:start]
        text = decode_continuation(self.decode_text, context, out[start:])  # type: ignore[arg-type]
        return any(s in text for s in req.stop)

    # -- scheduling -------------------------------------------------------------------------------------
    def _prefix_blocks(self, req: _Request) -> tuple[list[int], list[bytes]]:
        """The leading full blocks of req's tokens found in the prefix cache, and their keys."""
        if not self.prefix_caching:
            return [], []
        bs, toks = self.cache.block_size, req.tokens
        blocks: list[int] = []
        digests: list[bytes] = []
        parent = b""
        for i in range(len(toks) // bs):
            parent = block_digest(parent, toks[i * bs:(i + 1) * bs])
            b = self.cache.allocator.lookup(parent)
            if b is None:
                break
            blocks.append(b)
            digests.append(parent)
        return blocks, digests

    def _admit(self) -> None:
        alloc, bs = self.cache.allocator, self.cache.block_size
        while self.waiting and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            blocks, digests = self._prefix_blocks(req)
            if self.prefix_caching and req.head and self.running and any(
                    r.head == req.head and r.computed < len(r.prompt) for r in self.running):
                break  # a running request is computing the same first block(s): wait and reuse them
            n = len(req.tokens)
            for _attempt in range(2):
                hit = min(len(blocks) * bs, n - 1)  # the last token is always fed: its logits are needed
                need = -(-n // bs) - len(blocks) + (1 if hit < len(blocks) * bs else 0)  # + the copy-on-write
                revived = sum(1 for b in blocks if alloc.ref_count(b) == 0)  # cached blocks stop being free
                free = alloc.num_free - revived - (self.watermark if self.running else 0)
                if need <= free or self.running or not blocks:
                    break
                blocks, digests = [], []  # alone and a request of the whole pool: the copy would not fit
            if need > free:
                break  # first come, first served: later requests wait too
            self.waiting.popleft()
            self.cache.add_sequence(req.id, blocks)
            if hit < len(blocks) * bs:
                self.cache.set_length(req.id, hit)
            req.computed, req.digests = hit, digests
            c = self.counters
            if not req.preemptions:
                c.prompt_tokens += len(req.prompt)
            c.prefix_query_tokens += n
            c.prefix_hit_tokens += hit
            self.running.append(req)

    def _preempt(self, req: _Request) -> None:
        """Free req's blocks and put it at the head of the queue: it is prefilled again from its tokens."""
        self.running.remove(req)
        self.cache.free_sequence(req.id)
        self.counters.preemptions += 1
        self.counters.recomputed_tokens += req.computed
        req.preemptions += 1
        req.computed, req.digests = 0, []
        # ahead of every never-started request, behind earlier preempted ones (arrival order among them)
        i = 0
        while i < len(self.waiting) and self.waiting[i].preemptions and self.waiting[i].id < req.id:
            i += 1
        self.waiting.insert(i, req)

    def _victim(self, keep: _Request) -> _Request | None:
        cands = [r for r in self.running if r is not keep and self.cache.tables[r.id]]
        if not cands:
            return None
        if self.preemption == "least_work":
            return min(cands, key=lambda r: (r.computed, -r.id))
        return max(cands, key=lambda r: r.id)

    def _reserve(self, req: _Request, n: int) -> bool:
        """Blocks for n more tokens of req, preempting others while the pool is short; False when req
        itself had to go (nobody else holds blocks)."""
        while not self.cache.reserve(req.id, n):
            victim = self._victim(req)
            if victim is None:
                self._preempt(req)
                return False
            self._preempt(victim)
        return True

    def _register(self, req: _Request) -> None:
        """Put req's newly filled blocks into the prefix cache."""
        if not self.prefix_caching:
            return
        bs, table, toks = self.cache.block_size, self.cache.tables[req.id], None
        while len(req.digests) < req.computed // bs:
            i = len(req.digests)
            toks = toks or req.tokens
            d = block_digest(req.digests[-1] if req.digests else b"", toks[i * bs:(i + 1) * bs])
            self.cache.allocator.register(table[i], d)
            req.digests.append(d)

    def _length_groups(self, batch: list[_Request]) -> list[list[int]]:
        """The decoding batch (indices into it) cut into groups of similar cached length, one forward each.

        A forward over the paged cache gathers and attends over every row padded to the batch's longest
        sequence, so a batch of 16..768-token sequences spends about half its key/value traffic on padding.
        Cutting the length-sorted batch where sum(rows x longest) + split_cost per extra forward (the fixed
        cost of a forward, weights and Python, in row x key units) is smaller saves that traffic; binary cuts,
        at most 2 ** split_depth groups. split_cost=None: one forward. The default ("auto") is None where the
        paged cache's decoding step reads the keys/values in place (CPU, float32/64: no padding is read, and
        one forward over the whole batch was 1.11x in CPU time on the serve load), 4096
        where it gathers them (GPU, bf16)."""
        n = len(batch)
        if self.split_cost is None or n < 4:
            return [list(range(n))]
        lens = [self.cache.lens[r.id] + 1 for r in batch]
        order = sorted(range(n), key=lens.__getitem__)
        L = [lens[i] for i in order]
        out: list[list[int]] = []

        def cut(lo: int, hi: int, depth: int) -> None:
            best, at = (hi - lo) * L[hi - 1], 0
            if depth:
                for i in range(lo + 2, hi - 1):  # groups of at least 2 rows
                    c = (i - lo) * L[i - 1] + (hi - i) * L[hi - 1] + self.split_cost
                    if c < best:
                        best, at = c, i
            if not at:
                out.append(order[lo:hi])
                return
            cut(lo, at, depth - 1)
            cut(at, hi, depth - 1)

        cut(0, n, self.split_depth)
        return out if len(out) > 1 else [list(range(n))]  # one group: in batch order (its logits are used as is)

    def _track(self) -> None:
        self.peak_blocks = max(self.peak_blocks, self.cache.blocks_in_use)

    def _prefill(self, events: list[tuple[int, int]]) -> set[int]:
        """This step's prefill: up to prefill_chunk tokens in all, handed out in admission order (the oldest
        prompt first); the pieces of equal length go through one forward together (B rows of T tokens over
        the paged cache, per-row offsets and key mask), so short prompts and the last pieces of long ones do
        not cost a forward each. Returns the ids of the requests that emitted their first token."""
        emitted: set[int] = set()
        budget = self.prefill_chunk if self.prefill_chunk is not None else float("inf")
        pieces: list[tuple[_Request, int]] = []
        for req in self.running:
            pending = len(req.prompt) + len(req.output) - req.computed
            if pending <= 1:
                continue
            if budget <= 0:
                break
            n = int(min(pending, budget))
            pieces.append((req, n))
            budget -= n
        taken = [(req, n) for req, n in pieces if req in self.running and self._reserve(req, n)]
        by_len: dict[int, list[_Request]] = {}
        for req, n in taken:
            if req in self.running:  # not preempted by a later piece's reservation
                by_len.setdefault(n, []).append(req)
        for n, group in by_len.items():
            self.cache.set_active([r.id for r in group])
            ids = torch.tensor([r.tokens[r.computed:r.computed + n] for r in group], dtype=torch.long,
                               device=self.device)
            keep = self.cache.keep_mask(n) if len({self.cache.lens[r.id] for r in group}) > 1 else None
            logits = self.model.step(ids, self.cache, keep=keep)
            self._track()
            done = []
            for i, req in enumerate(group):
                done_now = req.computed + n == len(req.prompt) + len(req.output)
                req.computed += n
                self.counters.prefill_tokens += n
                self._register(req)
                if done_now:
                    done.append(i)
            if done:
                rows = [group[i] for i in done]
                for req, tok in zip(rows, self._choose(rows, logits if len(done) == len(group) else logits[done])):
                    emitted.add(req.id)
                    self._emit(req, tok, events)
        return emitted

    @torch.no_grad()
    def step(self) -> list[tuple[int, int]]:
        """Admit, prefill chunks, one decoding step for every other running request. Returns the (request
        id, token) pairs produced, in order; take_finished() names the requests that left."""
        events: list[tuple[int, int]] = []
        self._admit()
        emitted = self._prefill(events)
        batch = [r for r in self.running if r.id not in emitted and len(r.prompt) + len(r.output) - r.computed == 1]
        for req in list(batch):
            if req in self.running:
                self._reserve(req, 1)
        batch = [r for r in batch if r in self.running]
        if batch:
            parts = []
            for rows in self._length_groups(batch):
                group = [batch[i] for i in rows]
                self.cache.set_active([r.id for r in group])
                ids = torch.tensor([[r.output[-1] if r.output else r.prompt[-1]] for r in group], dtype=torch.long,
                                   device=self.device)
                keep = self.cache.keep_mask(1) if len({self.cache.lens[r.id] for r in group}) > 1 else None
                parts.append((rows, self.model.step(ids, self.cache, keep=keep)))  # per-row offsets: the cache's
            if len(parts) == 1:
                logits = parts[0][1]
            else:  # back in batch order: one token choice for the whole batch
                logits = torch.empty(len(batch), parts[0][1].shape[-1], dtype=parts[0][1].dtype, device=self.device)
                for rows, lg in parts:
                    logits[torch.tensor(rows, device=self.device)] = lg
            self._track()
            for req, tok in zip(batch, self._choose(batch, logits)):
                req.computed += 1
                self._register(req)
                self._emit(req, tok, events)
        if self.waiting and not self.running and not events:
            raise RuntimeError("the next waiting request does not fit in the free KV-cache blocks")
        self.counters.steps += 1
        return events

    def run(self) -> dict[int, list[int]]:
        """Step until every queued request is finished; returns {request id: new token ids}."""
        while self.has_work:
            self.step()
        return dict(self.finished)
