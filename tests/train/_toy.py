"""Tiny models and batch sources for the trainer tests (also imported by the torchrun script)."""

from __future__ import annotations

import torch

import qkv


def tiny_gpt(seed: int = 0, dropout: float = 0.0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    kw = dict(vocab_size=32, n_layers=2, d_model=32, n_heads=2, context_length=32, dropout=dropout)
    kw.update(overrides)
    return qkv.build("gpt-nano", **kw)


class ToyLM:
    """Rows drawn from a fixed pool: batch(i, bs) = rows [i*bs, (i+1)*bs), so 4 micro-batches of 8 are
    exactly one batch of 32. Rows have different lengths (4..max_len), right-padded with pad id 0,
    attention_mask 0 and labels -100 on the padding; each batch is padded to its own longest row."""

    def __init__(self, seed: int = 0, vocab: int = 32, max_len: int = 24, min_len: int = 4, pool: int = 4096):
        self.seed, self.vocab, self.max_len, self.min_len, self.pool = seed, vocab, max_len, min_len, pool

    def row(self, r: int, split: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + r * 2 + (split != "train"))
        n = int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=g))
        first = torch.randint(1, self.vocab, (1,), generator=g)
        # a learnable pattern: each token is the previous + 1 (mod vocab, skipping 0)
        return (first - 1 + torch.arange(n)) % (self.vocab - 1) + 1

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, torch.Tensor]:
        rows = [self.row((index * batch_size + j) % self.pool, split) for j in range(batch_size)]
        T = max(len(r) for r in rows)
        ids = torch.zeros(batch_size, T, dtype=torch.long)
        mask = torch.zeros(batch_size, T, dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, : len(r)] = r
            mask[j, : len(r)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
