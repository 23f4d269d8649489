"""Continuous batching over a paged KV cache, for GPT-family (decoder-only) models.

    engine = Engine(model, block_size=16, max_batch_size=32)
    ids = [engine.add_request(prompt, max_new_tokens=64) for prompt in prompts]
    outputs = engine.run()                      # {request id: [new token ids]}
    # or step by step: engine.step() -> [(request id, token), ...]; add requests between steps

Each step first admits waiting requests while the batch has room and the pool has enough free blocks for
their worst case (prompt + max_new_tokens; blocks are still taken lazily, one at a time), prefills each
new request alone (its first token comes from the prefill), then runs ONE batched decoding step over every
running request, whatever its length. Finished requests (eos or max_new_tokens) leave at once and return
their blocks, so a waiting request can join at the next step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from qkv.generate.paged import PagedKVCache
from qkv.generate.sampling import check_sampling_args, process_logits, sample


@dataclass
class _Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    eos: set[int]
    blocks_needed: int
    output: list[int] = field(default_factory=list)


class Engine:
    def __init__(
        self,
        model: Any,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_batch_size: int = 32,
        eos_token_id: int | Sequence[int] | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> None:
        if hasattr(model, "encode") or not hasattr(model, "decoder"):
            raise ValueError("Engine serves decoder-only (GPT-family) models; use generate() for encoder-decoders")
        check_sampling_args(temperature, top_k, top_p)
        c = model.config
        self.model = model.eval()
        self.context = model.decoder.position.max_len  # None: no hard position limit
        limit = self.context or c.context_length
        if num_blocks is None:
            num_blocks = max_batch_size * -(-limit // block_size)
        p = model.tok_emb.weight
        self.cache = PagedKVCache(c.n_layers, c.n_kv_heads or c.n_heads, c.d_model // c.n_heads, num_blocks,
                                  block_size, dtype=p.dtype, device=p.device)
        self.device = p.device
        self.max_batch_size = max_batch_size
        self.default_eos = eos_token_id
        self.sampling = do_sample and temperature > 0
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator = torch.Generator(device=p.device).manual_seed(seed) if seed is not None else None
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.finished: dict[int, list[int]] = {}
        self._reserved = 0
        self._next_id = 0
        self.peak_blocks = 0
        self.steps = 0

    # -- requests ---------------------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int] | Tensor, max_new_tokens: int = 32, *,
                    eos_token_id: int | Sequence[int] | None = None) -> int:
        """Queue a prompt (1-D ids); returns the request id used by step() and run()."""
        ids = [int(t) for t in (prompt.tolist() if isinstance(prompt, Tensor) else prompt)]
        vocab = self.model.config.vocab_size
        if not ids:
            raise ValueError("a request needs at least one prompt token")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt contains a token id outside the vocabulary [0, {vocab})")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if self.context is not None and len(ids) + max_new_tokens > self.context:
            raise ValueError(f"prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} exceeds the "
                             f"model's context of {self.context} positions")
        eos = eos_token_id if eos_token_id is not None else self.default_eos
        eos_set = set() if eos is None else ({int(eos)} if isinstance(eos, int) else {int(e) for e in eos})
        need = -(-(len(ids) + max(max_new_tokens - 1, 0)) // self.cache.block_size)
        if need > self.cache.allocator.num_blocks:
            raise ValueError(f"the request needs {need} blocks but the pool has only "
                             f"{self.cache.allocator.num_blocks}")
        rid = self._next_id
        self._next_id += 1
        req = _Request(rid, ids, max_new_tokens, eos_set, need)
        if max_new_tokens == 0:
            self.finished[rid] = []
        else:
            self.waiting.append(req)
        return rid

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- decoding ---------------------------------------------------------------------------------------
    def _choose(self, logits: Tensor) -> list[int]:
        if self.sampling:
            logits = process_logits(logits.float(), temperature=self.temperature, top_k=self.top_k,
                                    top_p=self.top_p)
            return sample(logits, self.generator).tolist()
        return logits.argmax(-1).tolist()

    def _emit(self, req: _Request, tok: int, events: list[tuple[int, int]]) -> bool:
        """Record a token; True when the request is finished."""
        req.output.append(tok)
        events.append((req.id, tok))
        return tok in req.eos or len(req.output) >= req.max_new_tokens

    def _finish(self, req: _Request) -> None:
        self.cache.free_sequence(req.id)
        self._reserved -= req.blocks_needed
        self.finished[req.id] = req.output

    def _admit(self, events: list[tuple[int, int]]) -> None:
        free = self.cache.allocator.num_blocks - self._reserved
        while self.waiting and len(self.running) < self.max_batch_size and self.waiting[0].blocks_needed <= free:
            req = self.waiting.popleft()
            self._reserved += req.blocks_needed
            free -= req.blocks_needed
            self.cache.add_sequence(req.id)
            self.cache.set_active([req.id])
            ids = torch.tensor([req.prompt], dtype=torch.long, device=self.device)
            logits = self.model(ids, cache=self.cache, last_only=True).logits[:, -1]
            self._track()
            if self._emit(req, self._choose(logits)[0], events):
                self._finish(req)
            else:
                self.running.append(req)

    def _track(self) -> None:
        self.peak_blocks = max(self.peak_blocks, self.cache.blocks_in_use)

    @torch.no_grad()
    def step(self) -> list[tuple[int, int]]:
        """Admit what fits, then one decoding step for every running request. Returns the (request id,
        token) pairs produced, in order."""
        events: list[tuple[int, int]] = []
        self._admit(events)
        if self.running:
            batch = self.running
            self.cache.set_active([r.id for r in batch])
            ids = torch.tensor([[r.output[-1]] for r in batch], dtype=torch.long, device=self.device)
            keep = self.cache.keep_mask(1)
            logits = self.model(ids, attention_mask=keep, cache=self.cache, last_only=True).logits[:, -1]
            self._track()
            still = []
            for req, tok in zip(batch, self._choose(logits)):
                if self._emit(req, tok, events):
                    self._finish(req)
                else:
                    still.append(req)
            self.running = still
        if self.waiting and not self.running and not events:
            raise RuntimeError("the next waiting request does not fit in the free KV-cache blocks")
        self.steps += 1
        return events

    def run(self) -> dict[int, list[int]]:
        """Step until every queued request is finished; returns {request id: new token ids}."""
        while self.has_work:
            self.step()
        return dict(self.finished)
