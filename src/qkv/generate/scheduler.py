"""The Engine's scheduler: which requests run this step, and how many of their tokens each feeds.

Admission (first come, first served, preempted requests ahead of never-started ones, while the batch has
room and the free blocks hold the uncached prompt), chunked prefill (a budget of prefill_chunk tokens a
step, the oldest prompt first, pieces of equal length grouped for one forward), the decoding batch cut into
groups of similar cached length, and preemption by recomputation when a write finds no free block. The
policy is described in engine.py's docstring; the blocks are the BlockManager's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from qkv.generate.blocks import BlockManager
from qkv.generate.config import GenerationConfig


@dataclass(eq=False)  # identity: `req in self.running` must not compare every field
class Request:
    id: int
    prompt: list[int]
    cfg: GenerationConfig
    max_new_tokens: int
    eos: set[int]
    pipe: Any  # its processors.Pipeline (the Sampler's)
    stop: Any = None  # its output.StopStrings, None: no stop strings
    output: list[int] = field(default_factory=list)
    computed: int = 0  # tokens of prompt + output whose keys/values are in the cache
    digests: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks, in order
    preemptions: int = 0
    head: bytes = b""  # prefix-cache key of its first block (b"": shorter than a block)
    images: list = field(default_factory=list)  # its images (images.Span), in prompt order
    extra: dict[int, bytes] = field(default_factory=dict)  # block index -> image keys (images.block_extras)
    logprobs: int | None = None  # None: none; k: each new token's log-probability and its k most likely
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (computed in prefill)
    # the prompt's entries by position (logprobs.TokenLogprob; position 0 has none), while they are computed
    prompt_lp: list | None = None
    # parallel samples of the same prompt (n > 1): they start when this request's prompt is computed, on its
    # blocks (copy-on-write), each with its own token choice
    forks: list[Request] = field(default_factory=list)
    draft_tokens: int = 0  # tokens it drafts per decoding step (engine_speculation.py; 0: none)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def needs_prompt_logits(self) -> bool:
        """Its prompt's log-probabilities are still to compute: every prompt token must be fed (the prefix
        cache would skip some)."""
        return self.prompt_logprobs is not None and not self.output

    @property
    def pending(self) -> int:
        """Tokens of prompt + output not yet fed to the model."""
        return len(self.prompt) + len(self.output) - self.computed


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
    image_requests: int = 0  # admitted requests with images (first admission)
    images: int = 0  # their images


class Scheduler:
    def __init__(self, blocks: BlockManager, counters: Counters, *, max_batch_size: int,
                 prefill_chunk: int | None, preemption: str, split_cost: int | None) -> None:
        self.blocks, self.counters = blocks, counters
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        self.preemption = preemption
        self.split_cost, self.split_depth = split_cost, 2  # see length_groups
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # -- admission --------------------------------------------------------------------------------------
    def admit(self) -> None:
        """Move waiting requests into the batch while it has room and the free blocks hold them."""
        blocks_mgr = self.blocks
        while self.waiting and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            if len(self.running) + 1 + len(req.forks) > self.max_batch_size and self.running:
                break  # its parallel samples join the batch when its prompt is computed
            blocks, digests = ([], []) if req.needs_prompt_logits else blocks_mgr.cached_prefix(req.tokens,
                                                                                                 req.extra)
            if blocks_mgr.prefix_caching and req.head and self.running and any(
                    r.head == req.head and r.computed < len(r.prompt) for r in self.running):
                break  # a running request is computing the same first block(s): wait and reuse them
            n = len(req.tokens)
            for _attempt in range(2):
                hit, need, free = blocks_mgr.admission(n, blocks, bool(self.running))
                if need <= free or self.running or not blocks:
                    break
                blocks, digests = [], []  # alone and a request of the whole pool: the copy would not fit
            if need > free:
                break  # first come, first served: later requests wait too
            self.waiting.popleft()
            blocks_mgr.allocate(req.id, blocks, hit)
            req.computed, req.digests = hit, digests
            c = self.counters
            if not req.preemptions:
                c.prompt_tokens += len(req.prompt)
                c.image_requests += bool(req.images)
                c.images += len(req.images)
            c.prefix_query_tokens += n
            c.prefix_hit_tokens += hit
            self.running.append(req)

    # -- preemption -------------------------------------------------------------------------------------
    def preempt(self, req: Request) -> None:
        """Free req's blocks and put it at the head of the queue: it is prefilled again from its tokens."""
        self.running.remove(req)
        self.blocks.free(req.id)
        self.counters.preemptions += 1
        self.counters.recomputed_tokens += req.computed
        req.preemptions += 1
        req.computed, req.digests = 0, []
        # ahead of every never-started request, behind earlier preempted ones (arrival order among them)
        i = 0
        while i < len(self.waiting) and self.waiting[i].preemptions and self.waiting[i].id < req.id:
            i += 1
        self.waiting.insert(i, req)

    def victim(self, keep: Request) -> Request | None:
        cands = [r for r in self.running if r is not keep and self.blocks.holds_blocks(r.id)]
        if not cands:
            return None
        if self.preemption == "least_work":
            return min(cands, key=lambda r: (r.computed, -r.id))
        return max(cands, key=lambda r: r.id)

    def reserve(self, req: Request, n: int) -> bool:
        """Blocks for n more tokens of req, preempting others while the pool is short; False when req
        itself had to go (nobody else holds blocks)."""
        while not self.blocks.reserve(req.id, n):
            victim = self.victim(req)
            if victim is None:
                self.preempt(req)
                return False
            self.preempt(victim)
        return True

    # -- leaving ----------------------------------------------------------------------------------------
    def finish(self, req: Request) -> None:
        """req is done: out of the batch, its blocks back to the pool (full ones stay in the prefix cache)."""
        self.blocks.free(req.id)
        self.running.remove(req)

    def cancel(self, request_id: int) -> Request | None:
        """Drop a waiting or running request and free its blocks; None if it is not queued."""
        for req in self.waiting:
            if req.id == request_id:
                self.waiting.remove(req)
                return req
        for req in self.running:
            if req.id == request_id:
                self.finish(req)
                return req
        return None

    def register(self, req: Request) -> None:
        """Put req's newly filled blocks into the prefix cache."""
        if self.blocks.prefix_caching and len(req.digests) < req.computed // self.blocks.block_size:
            self.blocks.register(req.id, req.tokens, req.computed, req.digests, req.extra)

    # -- this step's work -------------------------------------------------------------------------------
    def prefill_groups(self) -> dict[int, list[Request]]:
        """This step's prefill pieces, {piece length: requests}: up to prefill_chunk tokens in all, handed out
        in admission order (the oldest prompt first), their blocks reserved (which may preempt others)."""
        budget = self.prefill_chunk if self.prefill_chunk is not None else float("inf")
        pieces: list[tuple[Request, int]] = []
        for req in self.running:
            if req.pending <= 1:
                continue
            if budget <= 0:
                break
            n = int(min(req.pending, budget))
            pieces.append((req, n))
            budget -= n
        taken = [(req, n) for req, n in pieces if req in self.running and self.reserve(req, n)]
        by_len: dict[int, list[Request]] = {}
        for req, n in taken:
            if req in self.running:  # not preempted by a later piece's reservation
                by_len.setdefault(n, []).append(req)
        return by_len

    def decode_batch(self, emitted: set[int]) -> list[Request]:
        """The running requests with one token to feed (none that emitted this step), a block each for it."""
        batch = [r for r in self.running if r.id not in emitted and r.pending == 1]
        for req in list(batch):
            if req in self.running:
                self.reserve(req, 1)
        return [r for r in batch if r in self.running]

    def length_groups(self, batch: list[Request], lens: list[int]) -> list[list[int]]:
        """The decoding batch (indices into it) cut into groups of similar cached length, one forward each.

        A forward over the paged cache gathers and attends over every row padded to the batch's longest
        sequence, so a batch of 16..768-token sequences spends about half its key/value traffic on padding.
        Cutting the length-sorted batch where sum(rows x longest) + split_cost per extra forward (the fixed
        cost of a forward, weights and Python, in row x key units) is smaller saves that traffic; binary cuts,
        at most 2 ** split_depth groups. split_cost=None: one forward. lens: each row's length after this
        step's token."""
        n = len(batch)
        if self.split_cost is None or n < 4:
            return [list(range(n))]
        order = sorted(range(n), key=lens.__getitem__)
        L = [lens[i] for i in order]
        out: list[list[int]] = []
        split_cost = self.split_cost

        def cut(lo: int, hi: int, depth: int) -> None:
            best, at = (hi - lo) * L[hi - 1], 0
            if depth:
                for i in range(lo + 2, hi - 1):  # groups of at least 2 rows
                    c = (i - lo) * L[i - 1] + (hi - i) * L[hi - 1] + split_cost
                    if c < best:
                        best, at = c, i
            if not at:
                out.append(order[lo:hi])
                return
            cut(lo, at, depth - 1)
            cut(at, hi, depth - 1)

        cut(0, n, self.split_depth)
        # one group: in batch order (its logits are used as they are)
        return out if len(out) > 1 else [list(range(n))]
