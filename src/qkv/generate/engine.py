"""Continuous batching over a paged KV cache, for decoder-only models (the decoder protocol).

    engine = Engine(model, block_size=16, max_batch_size=32)            # + engine-wide generation settings
    ids = [engine.add_request(prompt, max_new_tokens=64) for prompt in prompts]
    ids.append(engine.add_request(prompt, GenerationConfig(do_sample=True, top_p=0.9, seed=1)))  # per request
    outputs = engine.run()                      # {request id: [new token ids]}
    # or step by step: engine.step() -> [(request id, token), ...]; add requests between steps

Each step first admits waiting requests while the batch has room and the pool has enough free blocks for
their worst case (prompt + max_new_tokens; blocks are still taken lazily, one at a time), prefills each
new request alone (its first token comes from the prefill), then runs ONE batched decoding step (the
model's fast `step` on the paged cache, with per-row offsets and key mask) over every running request,
whatever its length. Finished requests (eos or max_new_tokens) leave at once and return their blocks, so a
waiting request can join at the next step.

Settings: the engine's GenerationConfig (model defaults, then the config and keywords given to Engine) is
every request's base; a request may bring its own config and keywords on top. Requests that share the
engine's settings are processed as one batch; a request with its own settings gets its own logits
processors (and, if it sets a seed, its own random generator).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from qkv.generate.config import GenerationConfig
from qkv.generate.processors import Context, Pipeline
from qkv.generate.search import settings
from qkv.models.decoding import as_decoder
from qkv.nn.checks import check_id_list


@dataclass
class _Request:
    id: int
    prompt: list[int]
    cfg: GenerationConfig
    max_new_tokens: int
    eos: set[int]
    blocks_needed: int
    pipe: Pipeline
    output: list[int] = field(default_factory=list)


class Engine:
    def __init__(
        self,
        model: Any,
        generation_config: GenerationConfig | None = None,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_batch_size: int = 32,
        **options: Any,
    ) -> None:
        dec = as_decoder(model)
        if dec.is_seq2seq:
            raise ValueError("Engine serves decoder-only models; use generate() for encoder-decoders")
        self.model = dec
        model.eval()
        self.cfg = settings(dec, generation_config, options)
        self._check(self.cfg)
        self.context = dec.context_limit  # None: no hard position limit
        self.cache = dec.make_paged_cache(num_blocks, block_size, max_batch_size=max_batch_size)
        self.device = self.cache.device
        self.max_batch_size = max_batch_size
        seed = self.cfg.seed
        self.generator = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.finished: dict[int, list[int]] = {}
        self._reserved = 0
        self._next_id = 0
        self.peak_blocks = 0
        self.steps = 0

    @staticmethod
    def _check(cfg: GenerationConfig) -> None:
        if cfg.num_beams > 1 or cfg.num_return_sequences > 1:
            raise ValueError("the Engine decodes one sequence per request: num_beams and num_return_sequences must be 1")
        if cfg.stop_strings:
            raise ValueError("the Engine has no tokenizer for stop_strings: stop on eos_token_id instead")

    # -- requests ---------------------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int] | Tensor, generation_config: GenerationConfig | int | None = None,
                    **options: Any) -> int:
        """Queue a prompt (1-D ids) with this request's settings on top of the engine's (a GenerationConfig,
        or an int = max_new_tokens, and/or keywords); returns the request id used by step() and run()."""
        ids = [int(t) for t in (prompt.tolist() if isinstance(prompt, Tensor) else prompt)]
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
        if self.context is not None and len(ids) + max_new > self.context:
            raise ValueError(f"prompt of {len(ids)} tokens + max_new_tokens={max_new} exceeds the "
                             f"model's context of {self.context} positions")
        need = -(-(len(ids) + max(max_new - 1, 0)) // self.cache.block_size)
        if need > self.cache.allocator.num_blocks:
            raise ValueError(f"the request needs {need} blocks but the pool has only "
                             f"{self.cache.allocator.num_blocks}")
        generator = self.generator
        if "seed" in own and cfg.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        pipe = Pipeline(cfg, Context(len(ids), max_new, cfg.eos_ids), generator)
        rid = self._next_id
        self._next_id += 1
        req = _Request(rid, ids, cfg, max_new, set(cfg.eos_ids), need, pipe)
        if max_new == 0:
            self.finished[rid] = []
        else:
            self.waiting.append(req)
        return rid

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- decoding ---------------------------------------------------------------------------------------
    def _choose(self, reqs: list[_Request], logits: Tensor) -> list[int]:
        """Each request's next token from its row of logits, through its own settings. Requests sharing a
        settings object with no sequence-dependent processor form one batch (one sampling draw)."""
        out: list[int] = [0] * len(reqs)
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(reqs):
            key = id(r.cfg) if not r.pipe.processors else -1 - i  # processors read each row's own tokens
            groups.setdefault(key, []).append(i)
        for rows in groups.values():
            pipe = reqs[rows[0]].pipe
            if pipe.processors:
                (i,) = rows
                ids = torch.tensor([reqs[i].prompt + reqs[i].output], dtype=torch.long, device=self.device)
                out[i] = int(pipe.choose(ids, logits[i:i + 1])[0])
            else:
                toks = pipe.choose(None, logits[rows] if len(rows) < len(reqs) else logits).tolist()
                for i, t in zip(rows, toks):
                    out[i] = t
        return out

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
            logits, _ = self.model.prefill(ids, self.cache)
            self._track()
            if self._emit(req, self._choose([req], logits)[0], events):
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
            logits = self.model.step(ids, self.cache, keep=self.cache.keep_mask(1))  # per-row offsets: the cache's
            self._track()
            still = []
            for req, tok in zip(batch, self._choose(batch, logits)):
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
