"""The paged KV cache of multi-head latent attention (nn/mla.py), for the Engine and `qkv serve`.

MLA caches no per-head keys and values: per token and layer it keeps the normed latent c (kv_lora_rank wide)
and the one rotary key k_R (qk_rope_head_dim wide) that every head shares. This cache holds exactly those in
blocks: the block tables, reference counts, prefix cache, copy-on-write and the right-aligned layout of one
step (per-row offsets, keep_mask) are PagedKVCache's (nn/paged.py), inherited unchanged; only the pools and
what update() reads and writes differ.

Layout: two pools of plain rows, latents (n_layers, slots, kv_lora_rank) in `k` and rotary keys (n_layers,
slots, qk_rope_head_dim) in `v`, slot = block * block_size + i (LatentCache's naming: one key/value "head").
update(layer, c, k_R) writes the new tokens' rows, then gathers every active sequence's rows RIGHT-aligned
into (B, 1, length + T, kv_lora_rank) and (B, 1, length + T, rope): the layout of a left-padded LatentCache,
so MultiHeadLatentAttention reads it as it reads the static cache (forward() up-projects it, step() attends
over it in the absorbed form). The pool-reading decoding step of PagedKVCache (PoolKeys / PoolRows) is not
used: MLA's absorbed step already reads each cached latent once for all heads, and the gathered copy is
kv_lora_rank + rope numbers per token against a per-head cache's 2 * heads * head_dim. Reading in place would
need the latent twice (per block transposed for the scores, as rows for the weighted sum: it is both key and
value), doubling the cache; gathering into buffers reused across layers and steps (PagedKVCache._gather)
measured no faster than these fresh copies (docs/llm.md, "Limits" of the MLA section).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from qkv.nn.cache import KVCache
from qkv.nn.paged import PagedKVCache


class _Rows(NamedTuple):
    """One step's slots, made by the first layer and used by every layer."""

    write: Tensor  # (B * T,) slots of the new tokens
    gather: Tensor  # (B * (length + T),) slots of every key, right-aligned; masked columns read slot 0


class PagedLatentCache(PagedKVCache):
    def __init__(
        self,
        n_layers: int,
        kv_lora_rank: int,
        rope_dim: int,
        num_blocks: int,
        block_size: int = 16,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        KVCache.__init__(self)
        slots = num_blocks * block_size
        # not zeroed (as PagedKVCache's pools), except slot 0: the masked columns read it, and a masked
        # column must be finite (softmax weight 0 x NaN would be NaN)
        self.k = torch.empty(n_layers, slots, kv_lora_rank, dtype=dtype, device=device)  # latents c
        self.v = torch.empty(n_layers, slots, rope_dim, dtype=dtype, device=device)  # rotary keys k_R
        self.k[:, 0] = 0
        self.v[:, 0] = 0
        self.n_kv_heads = 1
        self._init_blocks(num_blocks, block_size)

    @property
    def step_reads_in_place(self) -> bool:
        """The decoding step gathers the latents (update()); the Engine splits batches by length for it."""
        return False

    @property
    def bytes_per_block(self) -> int:
        L, _, r = self.k.shape
        return L * self.block_size * (r + self.v.shape[-1]) * self.k.element_size()

    def _copy_block(self, old: int, new: int) -> None:
        bs = self.block_size
        for pool in (self.k, self.v):
            pool[:, new * bs:(new + 1) * bs] = pool[:, old * bs:(old + 1) * bs]

    def update(self, layer: int, c: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        """c (B, 1, T, kv_lora_rank) latents and k_rope (B, 1, T, rope) rotary keys of the active sequences'
        T new tokens -> every cached + new one, (B, 1, length + T, ...) each, right-aligned."""
        B, _, T, r = c.shape
        if B != len(self.active):
            raise ValueError(f"the batch has {B} rows but {len(self.active)} sequences are active")
        if self._plan is None:  # set_active() and advance() forget it
            _, write, gather, _ = self._slots(T)
            self._plan = _Rows(write.reshape(-1), gather.reshape(-1))  # type: ignore[assignment]
        rows: _Rows = self._plan  # type: ignore[assignment]
        latents, rope = self.k[layer], self.v[layer]
        latents.index_copy_(0, rows.write, c.reshape(B * T, r))
        rope.index_copy_(0, rows.write, k_rope.reshape(B * T, -1))
        tk = rows.gather.shape[0] // B
        return (latents.index_select(0, rows.gather).view(B, 1, tk, r),
                rope.index_select(0, rows.gather).view(B, 1, tk, -1))

    def step_update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.update(layer, k, v)
