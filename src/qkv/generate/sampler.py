"""The Engine's sampler: each request's next token from its row of the step's logits, by its own settings.

A request's settings become a processors.Pipeline (its logits processors, warpers and the draw). Its random
generator is the engine's (seeded by the engine's settings, drawn from in batch order) unless the request
brings its own seed: then it has a generator of its own, so it draws the same tokens whatever else is in the
batch. Plain greedy rows share one argmax; rows sharing a settings object with no sequence-dependent
processor share one draw.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from qkv.generate.config import GenerationConfig
from qkv.generate.processors import Context, Pipeline


class Sampler:
    def __init__(self, device: torch.device, seed: int | None, errors: dict[int, str], tokenizer: Any = None,
                 vocab_size: int | None = None) -> None:
        self.device = device
        # a grammar's vocabulary (GenerationConfig.grammar): the engine's tokenizer, the model's columns
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        self.errors = errors  # request id -> why its token choice failed (the Engine's errors)

    def pipeline(self, cfg: GenerationConfig, prompt_len: int, max_new: int, own_seed: bool) -> Pipeline:
        """A request's token choice; own_seed: it set cfg.seed itself (its own generator)."""
        generator = self.generator
        if own_seed and cfg.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        ctx = Context(prompt_len, max_new, cfg.eos_ids, tokenizer=self.tokenizer, vocab_size=self.vocab_size)
        return Pipeline(cfg, ctx, generator)

    def choose(self, reqs: list[Any], logits: Tensor) -> list[int | None]:
        """Each request's next token from its row of logits (reqs: scheduler.Request, with .pipe, .cfg,
        .tokens, .id). None: that request's own settings broke its token choice (self.errors says how); the
        others go on."""
        out: list[int | None] = [0] * len(reqs)
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(reqs):
            p = r.pipe
            key = -1 if not (p.processors or p.sampling) else id(r.cfg) if not p.processors else -2 - i
            groups.setdefault(key, []).append(i)
        for key, rows in groups.items():
            # one row: a view (a request with its own processors: a grammar's, a penalty's); indexing with a
            # list took 20 ms for one (1, 32000) row on a loaded 2-core CPU (torch's threaded index kernel)
            sub = logits if len(rows) == len(reqs) else logits[rows[0]:rows[0] + 1] if len(rows) == 1 else \
                logits.index_select(0, torch.tensor(rows, device=logits.device))
            if key == -1:
                toks = sub.argmax(-1).tolist()
            else:
                r = reqs[rows[0]]
                ids = (torch.tensor([r.tokens], dtype=torch.long, device=self.device)
                       if r.pipe.processors else None)
                try:
                    toks = r.pipe.choose(ids, sub).tolist()
                except RuntimeError as e:
                    # settings that turn this request's scores non-finite (a repetition_penalty of 1e-300
                    # divides them into inf, softmax makes NaN, torch.multinomial refuses them) fail this
                    # request only: raised here, they would stop the whole engine and every other request
                    for i in rows:
                        out[i] = None
                        self.errors[reqs[i].id] = f"sampling failed for this request's settings: {e}"
                    continue
            for i, t in zip(rows, toks):
                out[i] = t
        return out
