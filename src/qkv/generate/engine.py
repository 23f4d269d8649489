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
   similar length, one forward each (Scheduler.length_groups: each forward gathers and attends over its rows
   padded to its own longest sequence, not the batch's).

Speculative decoding (engine_speculation.py): a request with prompt_lookup_num_tokens (EngineConfig
speculative="prompt-lookup": every request) drafts tokens by n-gram lookup in its own prompt + output, or,
with Engine(..., draft_model=small), a small model of the same vocabulary drafts them; its
decoding row feeds them after its last token (rows of equal draft length through one forward), the target's
logits at each position accept or reject them by speculative.py's rule, and the rejected positions' cache is
given back. Greedy tokens are those of plain decoding.

Preemption by recomputation (vLLM's default): when a write needs a block and none is free (cached,
unreferenced prefix blocks count as free and are evicted least-recently-used first), a victim's blocks are
freed and it goes back to the head of the waiting queue with its S; when re-admitted it is prefilled from
S (its full blocks often still in the prefix cache). Victims: `preemption="least_work"` (default) takes
the running request with the fewest computed tokens (the cheapest to recompute), "newest" (vLLM's order) the
latest arrival. On benchmarks/serve.py's load with a third of the blocks it needs, least_work threw away
26.7k computed tokens against newest's 35.5k, and finished sooner in both quiet passes (docs/serving.md).
Greedy outputs do not change: the recomputed keys/values are those of the same tokens.

Settings: the engine's GenerationConfig (model defaults, then the config and keywords given to Engine) is
every request's base; a request may bring its own config and keywords on top (max_new_tokens, temperature,
top_k, top_p, eos_token_id, stop_strings, seed, ...). Greedy requests without sequence-dependent processors
share one argmax; the others go through their own logits processors (and, with a seed, their own random
generator, so a seeded request draws the same tokens whatever else is in the batch).
Stop strings need `tokenizer` (an object with .decode(ids) or a callable ids -> str); they are looked for in
the output's text as it streams, decoded after the prompt's tail (output.py).

Images (a LLaVA model): add_request(ids, images=[ImageInput(pixel_values, key=...)]) with the placeholders
expanded in ids; the prefill pieces that hold placeholders take the images' projected embeddings there
(model.step_with_images), a full block's prefix-cache key also hashes its images' keys, and an LRU of
embeddings by key spares a repeated image the vision tower (images.py). Decoding is unchanged. A vision
tower that raises fails only the requests whose images it could not encode ("error"), as a failed token
choice does.

Parallel samples and log-probabilities: add_request(ids, n=4) queues one request whose prompt is computed
once; when it is, three more sequences start on its blocks (PagedKVCache.fork: shared, the partial last block
copied by its first writer), request ids rid + 1 .. rid + 3, each with its own token choice (a seed s: s + i).
logprobs=k records each new token's log-probability and its k most likely alternatives (token_logprobs());
prompt_logprobs=k the prompt tokens' (prompt_logprobs()), from every position's logits of its prefill pieces
(model.step(all_logits=True)); such a request skips the prefix cache for its prompt (cached blocks have their
keys and values, not their logits). The values are log_softmax of the model's raw logits (logprobs.py).

The parts (vLLM v1's split): scheduler.py (admission, chunked prefill, preemption), blocks.py (the KV blocks
each request holds, the prefix cache), sampler.py (processors, seeds), output.py (finish reasons, stop
strings); this class checks the settings, wires them and runs the model's forwards.
"""

from __future__ import annotations

import inspect
import numbers
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from qkv.generate.blocks import BlockManager
from qkv.generate.config import GenerationConfig
from qkv.generate.engine_config import PREEMPTION, EngineConfig
from qkv.generate.engine_speculation import Drafter, draft_length
from qkv.generate.images import ImageEncoder, ImageInput, Span, block_extras, check_images, in_piece, spans
from qkv.generate.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprobs
from qkv.generate.output import TEXT_CONTEXT, OutputProcessor
from qkv.generate.sampler import Sampler
from qkv.generate.scheduler import Counters, Request, Scheduler
from qkv.generate.search import settings
from qkv.generate.speculative import Draft
from qkv.models.decoding import as_decoder, configured_context
from qkv.nn.checks import check_id_list

__all__ = ["PREEMPTION", "TEXT_CONTEXT", "Counters", "Engine", "EngineConfig", "ImageInput"]


def _prompt_ids(prompt: Sequence[int] | Tensor) -> list[int]:
    """A prompt as a list of int token ids; TypeError for anything else (1.7 would become token 1)."""
    if isinstance(prompt, Tensor):
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool \
                or prompt.dim() != 1:
            raise TypeError(f"a prompt tensor must be 1-D integer token ids, got {prompt.dtype} of shape "
                            f"{tuple(prompt.shape)}")
        prompt = prompt.tolist()
    bad = next((t for t in prompt if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
    if bad is not None:
        raise TypeError(f"a prompt is a list of int token ids, got {type(bad).__name__} {bad!r}")
    return [int(t) for t in prompt]


class Engine:
    def __init__(
        self,
        model: Any,
        generation_config: GenerationConfig | None = None,
        *,
        config: EngineConfig | None = None,
        tokenizer: Any = None,
        draft_model: Any = None,
        **options: Any,
    ) -> None:
        """`config`: the engine's settings (EngineConfig); its field names as keywords build or override one
        (Engine(model, block_size=16)); every other keyword is a generation setting of the engine's base.
        draft_model: a small decoder of the model's vocabulary that drafts config.speculative_tokens tokens
        per step for every request (engine_speculation.py)."""
        options = dict(options)
        self.config = c = EngineConfig.merged(config, options)
        dec = as_decoder(model)
        if dec.is_seq2seq:
            raise ValueError("Engine serves decoder-only models; use generate() for encoder-decoders")
        self.model = dec
        model.eval()
        self.cfg = settings(dec, generation_config, options)
        self.decode_text: Callable[[list[int]], str] | None = (
            None if tokenizer is None else tokenizer.decode if hasattr(tokenizer, "decode") else tokenizer)
        self._check(self.cfg)
        # the longest prompt + output a request may ask for (checked before it takes blocks): by default the
        # model's context, for RoPE / ALiBi models the context they were configured for (vLLM's max_model_len)
        self.context = configured_context(dec)
        if c.max_model_len is not None:
            if dec.context_limit is not None and c.max_model_len > dec.context_limit:
                raise ValueError(f"max_model_len={c.max_model_len} exceeds the model's context of "
                                 f"{dec.context_limit} positions (its position table ends there)")
            self.context = c.max_model_len
        self.cache = dec.make_paged_cache(c.num_blocks, c.block_size, max_batch_size=c.max_batch_size)
        self.device = self.cache.device
        split_cost = c.split_cost
        if split_cost == "auto":  # the split saves padding traffic, which only a step that gathers K/V has
            split_cost = None if self.cache.step_reads_in_place else 4096
        self.counters = Counters()
        self.blocks = BlockManager(self.cache, c.prefix_caching)
        self.scheduler = Scheduler(self.blocks, self.counters, max_batch_size=c.max_batch_size,
                                   prefill_chunk=c.prefill_chunk, preemption=c.preemption,
                                   split_cost=split_cost)
        self.output = OutputProcessor(self.decode_text, self.counters)
        self.sampler = Sampler(self.device, self.cfg.seed, self.output.errors, tokenizer,
                               dec.output_vocab_size)
        self.generator = self.sampler.generator
        # a vision-language model's images: their embeddings, by content hash (images.py)
        self.images = ImageEncoder(dec, c.image_cache) if hasattr(dec, "step_with_images") else None
        self._next_id = 0
        self.peak_blocks = 0
        # a model whose step can return every position's logits can give a prompt's log-probabilities
        self.all_logits = "all_logits" in inspect.signature(dec.step).parameters
        self._forked: dict[int, Request] = {}  # a parallel sample not started yet -> the request it forks
        # speculative decoding (engine_speculation.py): its drafts are checked on every position's logits
        self.drafter = Drafter(c, draft_model, dec.output_vocab_size, self.device)
        self.speculation = self.drafter.stats

    # -- the parts' state, under the names callers use -------------------------------------------------
    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def max_batch_size(self) -> int:
        return self.scheduler.max_batch_size

    @property
    def prefill_chunk(self) -> int | None:
        return self.scheduler.prefill_chunk

    @property
    def preemption(self) -> str:
        return self.scheduler.preemption

    @property
    def split_cost(self) -> int | None:
        return self.scheduler.split_cost

    @split_cost.setter
    def split_cost(self, value: int | None) -> None:
        self.scheduler.split_cost = value

    @property
    def split_depth(self) -> int:
        return self.scheduler.split_depth

    @property
    def prefix_caching(self) -> bool:
        return self.blocks.prefix_caching

    @property
    def watermark(self) -> int:
        return self.blocks.watermark

    @property
    def finished(self) -> dict[int, list[int]]:
        return self.output.finished

    @property
    def finish_reason(self) -> dict[int, str]:
        """"stop" (eos / stop string), "length", "cancelled", "error"."""
        return self.output.finish_reason

    @property
    def errors(self) -> dict[int, str]:
        """Why a request finished with "error" (until pop_finished)."""
        return self.output.errors

    @property
    def steps(self) -> int:
        return self.counters.steps

    def _check(self, cfg: GenerationConfig) -> None:
        if cfg.num_beams > 1 or cfg.num_return_sequences > 1:
            raise ValueError("the Engine decodes one sequence per request: num_beams and "
                             "num_return_sequences must be 1")
        if cfg.stop_strings and self.decode_text is None:
            raise ValueError("stop_strings need the Engine's tokenizer= (to decode the tokens)")
        V = self.model.output_vocab_size
        bad = [i for i in cfg.logit_bias or {} if i >= V]
        if bad:
            raise ValueError(f"logit_bias {bad[0]} is outside the model's vocabulary [0, {V})")

    # -- requests ---------------------------------------------------------------------------------------
    def room(self, prompt_len: int) -> int:
        """The most new tokens a prompt of this length can ask for: what the context and the whole KV pool
        leave (the last new token is never written to the cache). < 1: the prompt alone does not fit."""
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

    def _image_spans(self, ids: list[int], images: Sequence[ImageInput] | None) -> list[Span]:
        """The request's images on its placeholders (images.py); [] for a text request. Checks the ids."""
        if self.images is None:
            if images:
                raise ValueError(f"{type(self.model).__name__} takes no images (it has no vision tower)")
            check_id_list(ids, self.model.output_vocab_size)
            return []
        c = self.model.config
        images = list(images or [])
        check_images(images, (c.vision.n_channels, c.vision.image_size, c.vision.image_size), c.text.d_model,
                     c.image_tokens)
        out = spans(ids, images, c.image_token_id, c.image_tokens)
        check_id_list([t for t in ids if t != c.image_token_id], self.model.output_vocab_size)
        return out

    def add_request(self, prompt: Sequence[int] | Tensor,
                    generation_config: GenerationConfig | int | None = None, *,
                    images: Sequence[ImageInput] | None = None, n: int = 1, logprobs: int | None = None,
                    prompt_logprobs: int | None = None, **options: Any) -> int:
        """Queue a prompt (1-D ids) with this request's settings on top of the engine's (a GenerationConfig,
        or an int = max_new_tokens, and/or keywords); returns the request id used by step(), run(),
        cancel(). images: a vision-language model's ImageInputs, one per image in the prompt, whose
        placeholders the ids hold expanded.

        n > 1: n samples of the prompt, request ids rid .. rid + n - 1, computed once and shared (each later
        one starts on the first's blocks, copy-on-write), each with its own random stream (a seed s: s + i
        for the i-th). logprobs=k: each new token's log-probability and its k most likely tokens'
        (token_logprob()); prompt_logprobs=k: the same for the prompt's tokens, computed in its prefill
        (prompt_logprobs())."""
        ids = _prompt_ids(prompt)
        if not ids:
            raise ValueError("a request needs at least one prompt token")
        image_spans = self._image_spans(ids, images)  # the one check of the ids, where they enter
        if isinstance(generation_config, int) and not isinstance(generation_config, bool):
            options = {"max_new_tokens": generation_config, **options}
            generation_config = None
        own = dict(generation_config.explicit()) if generation_config is not None else {}
        own.update({k: v for k, v in options.items() if v is not None})
        cfg = self.cfg.replace(**own) if own else self.cfg
        self._check(cfg)
        max_new = cfg.new_tokens(len(ids))
        self.check_request(len(ids), max_new)
        self._check_extras(n, logprobs, prompt_logprobs)
        extra = block_extras(image_spans, self.cache.block_size)
        reqs = []
        for i in range(n):
            # the i-th sample's own stream: the request's seed + i (torch takes 64-bit seeds)
            own_cfg = cfg.replace(seed=(cfg.seed + i) % 2 ** 64) if i and cfg.seed is not None else cfg
            pipe = self.sampler.pipeline(own_cfg, len(ids), max_new, own_seed="seed" in own)
            reqs.append(Request(self._next_id, ids, own_cfg, max_new, set(cfg.eos_ids), pipe,
                                self.output.stop_strings(ids, list(cfg.stop_strings or [])),
                                head=self.blocks.head(ids, extra), images=image_spans, extra=extra,
                                logprobs=logprobs,
                                draft_tokens=(draft_length(own_cfg, self.drafter.engine_tokens)
                                              if self.all_logits else 0)))
            self._next_id += 1
        req = reqs[0]
        req.forks, req.prompt_logprobs = reqs[1:], prompt_logprobs
        if prompt_logprobs is not None:
            req.prompt_lp = [None] * len(ids)
        if max_new == 0 and prompt_logprobs is None:  # done at once, reported like any other end
            for r in reqs:
                self.output.finish(r.id, [], "length")
        else:
            self._forked.update((r.id, req) for r in req.forks)
            self.scheduler.waiting.append(req)
        return req.id

    def _check_extras(self, n: int, logprobs: int | None, prompt_logprobs: int | None) -> None:
        if not (isinstance(n, int) and 1 <= n <= self.max_batch_size):
            raise ValueError(f"n must be an integer in [1, max_batch_size={self.max_batch_size}], got {n!r}")
        for name, k in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if k is not None and not (isinstance(k, int) and 0 <= k <= MAX_TOP_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {k!r}")
        if prompt_logprobs is not None and not self.all_logits:
            raise ValueError(f"{type(self.model).__name__}.step cannot return every position's logits: "
                             "no prompt_logprobs")

    def token_logprobs(self, request_id: int) -> list[TokenLogprob]:
        """The log-probability entries of the request's new tokens so far (it asked for logprobs; [] if
        not), until pop_finished."""
        return self.output.logprobs.get(request_id, [])

    def prompt_logprobs(self, request_id: int) -> list[TokenLogprob | None] | None:
        """The prompt's log-probability entries (the first token's None) once its prefill is done, taken
        (forgotten by the engine); None when not (yet) there."""
        return self.output.prompt_logprobs.pop(request_id, None)

    def cancel(self, request_id: int) -> bool:
        """Drop a waiting or running request and free every block it holds; False if it is not queued. Its
        parallel samples not started yet are dropped with it."""
        parent = self._forked.pop(request_id, None)
        if parent is not None:  # a sample waiting for its prompt: it never took a block
            parent.forks = [r for r in parent.forks if r.id != request_id]
            self.output.finish(request_id, [], "cancelled")
            return True
        req = self.scheduler.cancel(request_id)
        if req is None:
            return False
        self.drafter.forget(req.id)
        self.output.finish(req.id, req.output, "cancelled")
        for r in req.forks:
            self.cancel(r.id)
        return True

    def pop_finished(self, request_id: int) -> tuple[list[int], str] | None:
        """(tokens, finish reason) of a finished request, forgotten by the engine (a server's memory
        bound)."""
        return self.output.pop(request_id)

    def take_finished(self) -> list[int]:
        """The requests finished or cancelled since the last call (a server's signal to close streams)."""
        return self.output.take()

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
            "steps": c.steps, "image_requests": c.image_requests, "images": c.images,
            "images_encoded": self.images.encoded if self.images else 0,
            "image_cache_hits": self.images.hits if self.images else 0,
            "image_cache_entries": len(self.images.cache) if self.images else 0,
            "spec_draft_tokens": self.speculation.drafted, "spec_accepted_tokens": self.speculation.accepted,
            "spec_acceptance_rate": self.speculation.acceptance_rate,
        }

    # -- the model step ---------------------------------------------------------------------------------
    def _emit(self, req: Request, tok: int | None, events: list[tuple[int, int]]) -> bool:
        """Record a token; True when the request is finished (and then it has left the engine)."""
        reason = self.output.process(req, tok, events)
        if reason is None:
            return False
        self.scheduler.finish(req)
        self.output.finish(req.id, req.output, reason)
        return True

    def _length_groups(self, batch: list[Request]) -> list[list[int]]:
        """The decoding batch (indices into it) cut into groups of similar cached length, one forward each
        (Scheduler.length_groups). split_cost "auto" is None where the paged cache's decoding step reads the
        keys/values in place (CPU, float32/64: no padding is read, and one forward over the whole batch was
        1.11x in CPU time on the serve load), 4096 where it gathers them (GPU, bf16)."""
        return self.scheduler.length_groups(batch, [self.cache.lens[r.id] + 1 for r in batch])

    def _forward(self, group: list[Request], ids: list[list[int]], starts: list[int] | None = None,
                 all_logits: bool = False) -> Tensor:
        """One forward of B rows of T tokens over the paged cache (per-row offsets and key mask). starts: the
        rows' first positions where they may hold image placeholders (prompt tokens). all_logits: every
        position's logits (B, T, V), else the last's (B, V)."""
        self.cache.set_active([r.id for r in group])
        x = torch.tensor(ids, dtype=torch.long, device=self.device)
        keep = self.cache.keep_mask(x.shape[1]) if len({self.cache.lens[r.id] for r in group}) > 1 else None
        if all_logits:  # a text model (prompt_logprobs is refused for the others)
            return self.model.step(x, self.cache, keep=keep, all_logits=True)
        if starts is not None and self.images is not None and any(r.images for r in group):
            image = self.images.chunk([(r.images, s, x.shape[1]) for r, s in zip(group, starts)], self.device)
            if image is not None:
                where, features = image
                return self.model.step_with_images(x, self.cache, keep=keep, where=where, features=features)
        return self.model.step(x, self.cache, keep=keep)

    def _fail(self, req: Request, why: str) -> None:
        """Finish a running request with "error" (its blocks freed, `errors` says why); the others go on."""
        self.errors[req.id] = why
        self.scheduler.finish(req)
        self.output.finish(req.id, req.output, "error")
        for r in req.forks:  # its parallel samples never started: they end with it
            self._forked.pop(r.id, None)
            self.errors[r.id] = why
            self.output.finish(r.id, [], "error")
        req.forks = []

    def _encode_images(self, group: list[Request], n: int) -> list[Request]:
        """Encode the images the group's next n tokens hold before its forward (one batched vision forward,
        ImageEncoder.ensure). A vision tower that raises (an out-of-memory on many tiles) fails only the
        requests whose images it cannot encode (tried one request at a time when several were batched), like
        a failed token choice: raised here, it would stop the engine and every other request. Returns the
        requests that go on."""
        need = {r.id: [s for s, _, _ in in_piece(r.images, r.computed, n)] for r in group if r.images}
        need = {rid: own for rid, own in need.items() if own}
        if self.images is None or not need:
            return group
        failed: dict[int, Exception] = {}
        try:
            self.images.ensure([s for own in need.values() for s in own])
        except Exception as e:  # noqa: BLE001  one request's images: it fails; several: which ones?
            failed = {rid: e for rid in need} if len(need) == 1 else self._encode_each(need)
        for req in group:
            if req.id in failed:
                e = failed[req.id]
                self._fail(req, f"encoding this request's images failed: {type(e).__name__}: {e}")
        return [r for r in group if r.id not in failed]

    def _encode_each(self, need: dict[int, list[Span]]) -> dict[int, Exception]:
        """Each request's images on their own: {request id: the exception} for those that still fail."""
        failed = {}
        for rid, own in need.items():
            try:
                self.images.ensure(own)
            except Exception as e:  # noqa: BLE001
                failed[rid] = e
        return failed

    def _track(self) -> None:
        self.peak_blocks = max(self.peak_blocks, self.cache.blocks_in_use)

    def _prefill(self, events: list[tuple[int, int]]) -> set[int]:
        """This step's prefill pieces (Scheduler.prefill_groups), the pieces of equal length through one
        forward together, so short prompts and the last pieces of long ones do not cost a forward each.
        Returns the ids of the requests that emitted their first token."""
        emitted: set[int] = set()
        for n, group in self.scheduler.prefill_groups().items():
            group = self._encode_images(group, n)
            if not group:
                continue
            every = any(r.needs_prompt_logits for r in group)
            logits = self._forward(group, [r.tokens[r.computed:r.computed + n] for r in group],
                                   [r.computed for r in group], all_logits=every)
            self._track()
            if every:
                self._record_prompt_logprobs(group, logits)
                logits = logits[:, -1]
            done = []
            for i, req in enumerate(group):
                done_now = req.pending == n
                req.computed += n
                self.counters.prefill_tokens += n
                self.scheduler.register(req)
                if done_now:
                    done.append(i)
            if done:
                rows = [group[i] for i in done]
                rows_logits = logits if len(done) == len(group) else logits[done]
                emitted.update(self._choose(rows, rows_logits, events))
        return emitted

    def _record_prompt_logprobs(self, group: list[Request], logits: Tensor) -> None:
        """The prompt tokens' entries this piece's logits give (B, T, V): position p's logits score token
        p + 1. Read before the rows' computed counts move."""
        T = logits.shape[1]
        for i, req in enumerate(group):
            if not req.needs_prompt_logits:
                continue
            c, P = req.computed, len(req.prompt)
            m = min(T, P - 1 - c)  # the positions whose next token is a prompt token
            if m > 0:
                entries = token_logprobs(logits[i, :m], req.prompt[c + 1:c + 1 + m], req.prompt_logprobs)
                req.prompt_lp[c + 1:c + 1 + m] = entries

    def _choose(self, rows: list[Request], logits: Tensor, events: list[tuple[int, int]]) -> list[int]:
        """Each row's next token from its logits (B, V), recorded: the rows whose prompt is done start their
        parallel samples (on their blocks) and publish their prompt log-probabilities first; a row asked for
        no new token (only its prompt's log-probabilities) finishes without one. Returns the ids that
        emitted."""
        index = list(range(len(rows)))
        for i, req in enumerate(list(rows)):
            if req.output:
                continue
            if req.prompt_lp is not None:
                self.output.prompt_logprobs[req.id] = req.prompt_lp
                req.prompt_lp = None
            for child in req.forks:
                self._forked.pop(child.id, None)
                self.blocks.fork(req.id, child.id)
                child.computed, child.digests = req.computed, list(req.digests)
                self.scheduler.running.append(child)
                rows.append(child)
                index.append(i)
            req.forks = []
        live = [i for i, r in enumerate(rows) if r.max_new_tokens > 0]
        for r in rows:
            if r.max_new_tokens == 0:  # its prompt's log-probabilities were all it asked for
                self.scheduler.finish(r)
                self.output.finish(r.id, [], "length")
        if not live:
            return []
        rows, pick = [rows[i] for i in live], [index[i] for i in live]
        if pick != list(range(logits.shape[0])):  # parallel samples read their parent's row
            logits = logits[pick]
        toks = self.sampler.choose(rows, logits)
        want = [i for i, r in enumerate(rows) if r.logprobs is not None and toks[i] is not None]
        if want:
            top = max(rows[i].logprobs for i in want)
            entries = token_logprobs(logits[want], [toks[i] for i in want], top)
            for i, e in zip(want, entries):
                e.top = e.top[:rows[i].logprobs]
                self.output.logprobs.setdefault(rows[i].id, []).append(e)
        for req, tok in zip(rows, toks):
            self._emit(req, tok, events)
        return [r.id for r in rows]

    def _decode(self, batch: list[Request], events: list[tuple[int, int]]) -> None:
        """One decoding step for the batch, in length groups (one forward each), one token choice for all."""
        # a prompt's last token comes here when the rest was cached or prefilled: it may be an image's
        batch = self._encode_images(batch, 1)
        batch = self._speculate(batch, events)
        if not batch:
            return
        parts = []
        for rows in self._length_groups(batch):
            group = [batch[i] for i in rows]
            last = [[r.output[-1] if r.output else r.prompt[-1]] for r in group]
            starts = [r.computed for r in group] if any(r.images and not r.output for r in group) else None
            parts.append((rows, self._forward(group, last, starts)))
        if len(parts) == 1:
            logits = parts[0][1]
        else:  # back in batch order: one token choice for the whole batch
            first = parts[0][1]
            logits = torch.empty(len(batch), first.shape[-1], dtype=first.dtype, device=self.device)
            for rows, lg in parts:
                logits[torch.tensor(rows, device=self.device)] = lg
        self._track()
        for req in batch:
            req.computed += 1
            self.scheduler.register(req)
        self._choose(list(batch), logits, events)

    def _speculate(self, batch: list[Request], events: list[tuple[int, int]]) -> list[Request]:
        """The rows that draft this step fed with their drafts and checked (engine_speculation.py), those of
        equal draft length through one forward; returns the rows that decode plainly."""
        by_len: dict[int, list[tuple[Request, Draft]]] = {}
        plain = []
        proposals = self.drafter.draft(batch)
        for req in batch:
            proposal = proposals.get(req.id)
            # the draft's blocks only where they are free: speculating never preempts a request
            if proposal is not None and self.cache.reserve(req.id, 1 + proposal.tokens.numel()):
                by_len.setdefault(proposal.tokens.numel(), []).append((req, proposal))
            else:
                if proposal is not None:
                    self.drafter.unused(req)
                plain.append(req)
        for rows in by_len.values():
            group = [req for req, _ in rows]
            logits = self._forward(group, [[req.output[-1], *d.tokens.tolist()] for req, d in rows],
                                   all_logits=True)
            self._track()
            for (req, proposal), row in zip(rows, logits):
                self._accept(req, proposal, row, events)
        return plain

    def _accept(self, req: Request, proposal: Draft, logits: Tensor, events: list[tuple[int, int]]) -> None:
        """Check req's draft on its logits (k + 1, V), keep the accepted positions' keys/values (the rest and
        the blocks past them given back) and emit the tokens until one finishes the request."""
        try:
            toks = self.drafter.verify(req, logits, proposal)
        except RuntimeError as e:  # as Sampler.choose: this request's settings fail it, the others go on
            self.errors[req.id] = f"sampling failed for this request's settings: {e}"
            self._emit(req, None, events)
            return
        accepted = len(toks) - 1
        req.computed += 1 + accepted  # its last token and the accepted drafts; the newest is fed next
        self.cache.truncate(req.id, req.computed)
        self.blocks.register(req.id, req.tokens + toks[:accepted], req.computed, req.digests, req.extra)
        entries = token_logprobs(logits[:len(toks)], toks, req.logprobs) if req.logprobs is not None else []
        for i, tok in enumerate(toks):
            if entries:
                self.output.logprobs.setdefault(req.id, []).append(entries[i])
            if self._emit(req, tok, events):
                return

    @torch.no_grad()
    def step(self) -> list[tuple[int, int]]:
        """Admit, prefill chunks, one decoding step for every other running request. Returns the (request
        id, token) pairs produced, in order; take_finished() names the requests that left."""
        events: list[tuple[int, int]] = []
        finished = self.counters.finished
        self.scheduler.admit()
        emitted = self._prefill(events)
        batch = self.scheduler.decode_batch(emitted)
        if batch:
            self._decode(batch, events)
        self.drafter.retain(self.running)  # the draft caches of requests that left or were preempted
        # nothing ran and nothing left (a failed request frees its blocks for the next step): stuck
        if self.waiting and not self.running and not events and self.counters.finished == finished:
            raise RuntimeError("the next waiting request does not fit in the free KV-cache blocks")
        self.counters.steps += 1
        return events

    def run(self) -> dict[int, list[int]]:
        """Step until every queued request is finished; returns {request id: new token ids}."""
        while self.has_work:
            self.step()
        return dict(self.finished)
