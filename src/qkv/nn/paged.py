"""A paged KV cache: fixed-size blocks from one shared pool, a block table per sequence.

The static cache gives every sequence of a batch max_len positions; requests of very different lengths then
waste most of it. Here the pool holds num_blocks blocks of block_size positions (per layer, per kv head),
a sequence owns a list of block ids (its block table) and asks for a new block only when its last one is
full, so it wastes at most block_size - 1 positions. Blocks go back to the free pool when it finishes.
(The idea of vLLM's PagedAttention, Kwon et al. 2023, written with plain tensor indexing.)

Layout and one step. The pool is (n_layers, num_blocks * block_size, H_kv, hd): slot s = block * block_size
+ i. Each step serves the *active* sequences (set_active). update() writes the new keys/values of every
active sequence into its slots with one index_copy_, then gathers each sequence's keys RIGHT-aligned into
(B, H_kv, max_len + T, hd): sequence b's last key sits in the last column for every b, exactly like a
left-padded static cache. So the causal mask and ALiBi's bias (both bottom-right aligned) need nothing
special; keep_mask() hides the unused left part, and offset gives each sequence its own positions.
The write/gather indices are computed once per step (first layer) and reused by every layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.nn.cache import KVCache


class BlockAllocator:
    """A pool of num_blocks block ids with O(1) allocate / free."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"the paged KV cache is out of blocks (all {self.num_blocks} in use)")
        b = self._free.pop()
        self._used.add(b)
        return b

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated (double free?)")
            self._used.remove(b)
            self._free.append(b)


class PagedKVCache(KVCache):
    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        shape = (n_layers, num_blocks * block_size, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.device = self.k.device
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.active: list[int] = []
        self._lens_t = torch.zeros(0, dtype=torch.long, device=self.device)
        self._plan: tuple[Tensor, Tensor] | None = None
        self.length = 0
        self.max_len = num_blocks * block_size

    # -- sequences --------------------------------------------------------------------------------------
    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} is already in the cache")
        self.tables[seq_id], self.lens[seq_id] = [], 0

    def free_sequence(self, seq_id: int) -> None:
        self.allocator.free(self.tables.pop(seq_id))
        del self.lens[seq_id]
        if seq_id in self.active:
            self.set_active([s for s in self.active if s != seq_id])

    def set_active(self, seq_ids: list[int]) -> None:
        """The sequences (in batch order) that the next forward pass feeds."""
        missing = [s for s in seq_ids if s not in self.tables]
        if missing:
            raise ValueError(f"sequences {missing} are not in the cache; add_sequence() them first")
        self.active = list(seq_ids)
        self._lens_t = torch.tensor([self.lens[s] for s in self.active], dtype=torch.long, device=self.device)
        self.length = max((self.lens[s] for s in self.active), default=0)
        self._plan = None

    @property
    def offset(self) -> Tensor:  # type: ignore[override]
        """(B,) position of each active sequence's next token."""
        return self._lens_t

    def keep_mask(self, new_tokens: int) -> Tensor:
        """(B, length + new_tokens) bool: True on each active sequence's real (right-aligned) keys."""
        tk = self.length + new_tokens
        start = (self.length - self._lens_t).unsqueeze(1)  # (B, 1) first real column
        return torch.arange(tk, device=self.device).unsqueeze(0) >= start

    @property
    def blocks_in_use(self) -> int:
        return self.allocator.num_used

    @property
    def bytes_per_block(self) -> int:
        L, _, H, hd = self.k.shape
        return 2 * L * self.block_size * H * hd * self.k.element_size()

    # -- KVCache ----------------------------------------------------------------------------------------
    def _make_plan(self, T: int) -> tuple[Tensor, Tensor]:
        bs = self.block_size
        for s in self.active:  # grow each block table to hold len + T positions
            need = -(-(self.lens[s] + T) // bs)
            table = self.tables[s]
            while len(table) < need:
                table.append(self.allocator.allocate())
        width = max(len(self.tables[s]) for s in self.active)
        tables = torch.tensor([self.tables[s] + [0] * (width - len(self.tables[s])) for s in self.active],
                              dtype=torch.long, device=self.device)  # (B, width)
        lens = self._lens_t.unsqueeze(1)
        # write slots of the T new tokens: positions len .. len + T - 1
        p = lens + torch.arange(T, device=self.device)
        write = (tables.gather(1, p // bs) * bs + p % bs).reshape(-1)  # (B * T,)
        # gather slots, right-aligned: column t of row b holds position t - (length - len_b)
        tk = self.length + T
        p = torch.arange(tk, device=self.device).unsqueeze(0) - (self.length - lens)
        valid = p >= 0
        p = p.clamp_min(0)
        gather = torch.where(valid, tables.gather(1, p // bs) * bs + p % bs, 0)  # (B, tk); masked cols -> slot 0
        return write, gather

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        B, H, T, hd = k.shape
        if B != len(self.active):
            raise ValueError(f"the batch has {B} rows but {len(self.active)} sequences are active")
        if self._plan is None:
            self._plan = self._make_plan(T)
        write, gather = self._plan
        kl, vl = self.k[layer], self.v[layer]
        kl.index_copy_(0, write, k.transpose(1, 2).reshape(B * T, H, hd))
        vl.index_copy_(0, write, v.transpose(1, 2).reshape(B * T, H, hd))
        return kl[gather].transpose(1, 2), vl[gather].transpose(1, 2)  # (B, H, length + T, hd)

    def advance(self, n: int) -> None:
        for s in self.active:
            self.lens[s] += n
        self._lens_t = self._lens_t + n
        self.length += n
        self._plan = None

    def reorder(self, index: Tensor) -> None:
        raise NotImplementedError("the paged cache serves independent requests; use StaticCache for beams")
