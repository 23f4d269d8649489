"""A paged KV cache: fixed-size blocks from one shared pool, a block table per sequence.

The static cache gives every sequence of a batch max_len positions; requests of very different lengths then
waste most of it. Here the pool holds num_blocks blocks of block_size positions (per layer, per kv head),
a sequence owns a list of block ids (its block table) and asks for a new block only when its last one is
full, so it wastes at most block_size - 1 positions. Blocks go back to the free pool when it finishes.
(The idea of vLLM's PagedAttention, Kwon et al. 2023, written with plain tensor indexing.)

Sharing. Blocks are reference-counted: sequences that start with the same tokens can point their tables at
the same full blocks (the prefix cache of BlockAllocator, keyed by block_digest). A shared block, or one the
prefix cache holds, is never written: a write that would land in it copies it first (copy-on-write), which
happens when a sequence recomputes the last token of a fully cached prompt.

Layout and one step. The pool is (n_layers, H_kv * num_blocks * block_size, hd): row h * slots + s holds
head h of slot s = block * block_size + i. Each step serves the *active* sequences (set_active). update()
writes the new keys/values of every active sequence into its slots with one index_copy_, then gathers each
sequence's keys RIGHT-aligned with one index_select into a contiguous (B, H_kv, max_len + T, hd): sequence b's last key sits in the last column for every b, exactly like a
left-padded static cache. So the causal mask and ALiBi's bias (both bottom-right aligned) need nothing
special; keep_mask() hides the unused left part, and offset gives each sequence its own positions.
The write/gather indices are computed once per step (first layer) and reused by every layer, and the
gathered keys/values go into two buffers the cache keeps (every layer of every step reuses them): a fresh
tensor of that size per layer cost ~4x the copy itself on CPU (page faults of newly mapped memory).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.nn.cache import KVCache


class BlockAllocator:
    """A pool of num_blocks block ids with reference counts and a prefix cache.

    allocate() hands out a block with one reference; share() adds a reference (a second sequence reading the
    same keys/values); free() drops one and returns the block to the pool at zero. A block whose content was
    registered under a hash (register(): a full block, keyed by everything before and in it) stays findable
    by lookup() after its last reference is dropped: it waits in an LRU queue of cached blocks and is reused
    (its hash forgotten) only when no never-cached block is free. num_free counts both kinds: a cached block
    with no reference is free memory that happens to hold something worth keeping."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced blocks with a hash, oldest first
        self.refs: dict[int, int] = {}  # referenced blocks -> count
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return len(self.refs)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks still holding a registered prefix (reusable by lookup, evictable)."""
        return len(self._cached)

    def allocate(self) -> int:
        if self._free:
            b = self._free.pop()
        elif self._cached:
            b, _ = self._cached.popitem(last=False)  # least recently used
            del self._by_hash[self._hash_of.pop(b)]
            self.evictions += 1
        else:
            raise RuntimeError(f"the paged KV cache is out of blocks (all {self.num_blocks} in use)")
        self.refs[b] = 1
        return b

    def share(self, b: int) -> None:
        """One more reference to block b (in use, or cached and unreferenced)."""
        if b in self.refs:
            self.refs[b] += 1
        elif b in self._cached:
            del self._cached[b]
            self.refs[b] = 1
        else:
            raise ValueError(f"block {b} is neither in use nor cached")

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            n = self.refs.get(b)
            if n is None:
                raise ValueError(f"block {b} is not allocated (double free?)")
            if n > 1:
                self.refs[b] = n - 1
                continue
            del self.refs[b]
            if b in self._hash_of:
                self._cached[b] = None  # most recently used end
            else:
                self._free.append(b)

    def ref_count(self, b: int) -> int:
        return self.refs.get(b, 0)

    # -- prefix cache ---------------------------------------------------------------------------------------
    def register(self, b: int, digest: bytes) -> None:
        """Block b (full, in use) holds the keys/values of the prefix `digest` names. A block already holding
        the same prefix keeps the entry (two copies of one prefix: the newer is freed as a plain block)."""
        if digest not in self._by_hash and b not in self._hash_of:
            self._by_hash[digest] = b
            self._hash_of[b] = digest

    def is_registered(self, b: int) -> bool:
        return b in self._hash_of

    def lookup(self, digest: bytes) -> int | None:
        return self._by_hash.get(digest)

    def clear_prefix_cache(self) -> None:
        """Forget every registered prefix (unreferenced cached blocks become plain free blocks)."""
        self._free.extend(self._cached)
        self._cached.clear()
        self._hash_of.clear()
        self._by_hash.clear()


def block_digest(parent: bytes, tokens: list[int]) -> bytes:
    """The prefix-cache key of a full block: a SHA-256 chained over the previous block's key, so a block is
    found only after exactly the same tokens from position 0 (its keys/values depend on all of them)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class PoolRows(NamedTuple):
    """A decoding step's values left in the pool (PagedKVCache.step_update): row index[i, t] of `pool` (one
    layer's (H_kv * slots, hd) values) is key column t of batch-head i. weighted_sum(probs) is probs @ V
    computed straight from the pool by one embedding_bag (a weighted sum of rows), instead of gathering V
    into a contiguous copy and multiplying: one read of the values instead of a read, a write and a read."""

    pool: Tensor
    index: Tensor  # (B * H_kv, Tk) pool rows

    def weighted_sum(self, probs: Tensor) -> Tensor:
        """probs: (B * H_kv, G * T, Tk) attention weights (G query heads per key/value head) -> (B * H_kv, G * T, hd)."""
        n, q, tk = probs.shape
        idx = self.index if q == 1 else self.index.unsqueeze(1).expand(n, q, tk).reshape(n * q, tk)
        out = F.embedding_bag(idx, self.pool, mode="sum", per_sample_weights=probs.reshape(n * q, tk))
        return out.view(n, q, -1)


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
        # (layer, head * slot, hd): the rows of one step's gather come out as (B, H, tk, hd), contiguous,
        # which is what attention's batched matmul reads (no second copy of the gathered keys)
        self.n_kv_heads, self.slots = n_kv_heads, num_blocks * block_size
        shape = (n_layers, n_kv_heads * num_blocks * block_size, head_dim)
        # not zeroed: a step reads only written slots, and slot 0 for the masked (padding) columns, which is
        # zeroed here so that a masked key/value is finite (softmax weight 0 x NaN would be NaN). Zeroing a
        # pool sized for max_batch_size x context (GBs) took seconds per Engine; untouched pages cost nothing.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        for pool in (self.k, self.v):
            pool.view(n_layers, n_kv_heads, self.slots, head_dim)[:, :, 0] = 0
        self.device = self.k.device
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.active: list[int] = []
        self._lens_t = torch.zeros(0, dtype=torch.long, device=self.device)
        self._plan: tuple[Tensor, Tensor] | None = None
        # one step's gathered keys/values, reused by every layer and step (grown when a step needs more)
        self._kbuf = torch.empty(0, dtype=dtype, device=device)
        self._vbuf = torch.empty(0, dtype=dtype, device=device)
        self.length = 0
        self.max_len = num_blocks * block_size
        self.copies = 0  # copy-on-write block copies

    # -- sequences --------------------------------------------------------------------------------------
    def add_sequence(self, seq_id: int, shared: list[int] | tuple[int, ...] = ()) -> None:
        """A new sequence; `shared`: full blocks of a cached prefix it starts with (one more reference each;
        its length starts at len(shared) * block_size)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} is already in the cache")
        for b in shared:
            self.allocator.share(b)
        self.tables[seq_id], self.lens[seq_id] = list(shared), len(shared) * self.block_size

    def free_sequence(self, seq_id: int) -> None:
        # last block first: the LRU queue of cached blocks then evicts a sequence's tail before its prefix
        self.allocator.free(self.tables.pop(seq_id)[::-1])
        del self.lens[seq_id]
        if seq_id in self.active:
            self.set_active([s for s in self.active if s != seq_id])

    def set_length(self, seq_id: int, n: int) -> None:
        """Forget all but the first n cached positions of a sequence (they are written again next; a shared
        block among them is copied first)."""
        if not 0 <= n <= self.lens[seq_id]:
            raise ValueError(f"length {n} outside 0..{self.lens[seq_id]}")
        self.lens[seq_id] = n

    def blocks_needed(self, seq_id: int, new_tokens: int) -> int:
        """Free blocks that writing `new_tokens` more positions takes: new blocks, plus one copy when the
        first write lands in a block that others share or the prefix cache holds (copy-on-write)."""
        n, table = self.lens[seq_id], self.tables[seq_id]
        need = max(0, -(-(n + new_tokens) // self.block_size) - len(table))
        return need + (1 if self._must_copy(table, n) else 0)

    def _must_copy(self, table: list[int], n: int) -> bool:
        i = n // self.block_size
        if i >= len(table):
            return False
        b = table[i]
        return self.allocator.ref_count(b) > 1 or self.allocator.is_registered(b)

    def reserve(self, seq_id: int, new_tokens: int) -> bool:
        """Take the blocks for `new_tokens` more positions now (copying a shared block that would be written);
        False, taking nothing, when the pool has too few free blocks."""
        if self.blocks_needed(seq_id, new_tokens) > self.allocator.num_free:
            return False
        self._grow(seq_id, new_tokens)
        return True

    def _grow(self, seq_id: int, new_tokens: int) -> None:
        bs, n, table = self.block_size, self.lens[seq_id], self.tables[seq_id]
        if self._must_copy(table, n):  # copy-on-write: the block keeps its content for the others
            i, old = n // bs, table[n // bs]
            new = self.allocator.allocate()
            src, dst = slice(old * bs, (old + 1) * bs), slice(new * bs, (new + 1) * bs)
            for pool in (self.k, self.v):
                heads = pool.view(pool.shape[0], self.n_kv_heads, self.slots, -1)
                heads[:, :, dst] = heads[:, :, src]
            table[i] = new
            self.allocator.free([old])
            self.copies += 1
        need = -(-(n + new_tokens) // bs)
        while len(table) < need:
            table.append(self.allocator.allocate())

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
        L, _, hd = self.k.shape
        return 2 * L * self.block_size * self.n_kv_heads * hd * self.k.element_size()

    # -- KVCache ----------------------------------------------------------------------------------------
    def _make_plan(self, T: int) -> tuple[Tensor, Tensor]:
        bs = self.block_size
        for s in self.active:  # grow each block table to hold len + T positions (if reserve() did not)
            self._grow(s, T)
        width = max(len(self.tables[s]) for s in self.active)
        tables = torch.tensor([self.tables[s] + [0] * (width - len(self.tables[s])) for s in self.active],
                              dtype=torch.long, device=self.device)  # (B, width)
        lens = self._lens_t.unsqueeze(1)
        # write slots of the T new tokens: positions len .. len + T - 1
        p = lens + torch.arange(T, device=self.device)
        write = tables.gather(1, p // bs) * bs + p % bs  # (B, T) slots
        # gather slots, right-aligned: column t of row b holds position t - (length - len_b)
        tk = self.length + T
        p = torch.arange(tk, device=self.device).unsqueeze(0) - (self.length - lens)
        valid = p >= 0
        p = p.clamp_min(0)
        gather = torch.where(valid, tables.gather(1, p // bs) * bs + p % bs, 0)  # (B, tk); masked cols -> slot 0
        # rows of the (head * slot) pool, in (B, H, T) and (B, H, tk) order
        head = (torch.arange(self.n_kv_heads, device=self.device) * self.slots).view(1, -1, 1)
        return (head + write.unsqueeze(1)).reshape(-1), (head + gather.unsqueeze(1)).reshape(-1)

    def _write(self, layer: int, k: Tensor, v: Tensor) -> Tensor:
        """Write the active sequences' new keys/values into their slots; returns the gather rows."""
        B, H, T, hd = k.shape
        if B != len(self.active):
            raise ValueError(f"the batch has {B} rows but {len(self.active)} sequences are active")
        if self._plan is None:
            self._plan = self._make_plan(T)
        write, gather = self._plan
        self.k[layer].index_copy_(0, write, k.reshape(B * H * T, hd))
        self.v[layer].index_copy_(0, write, v.reshape(B * H * T, hd))
        return gather

    def _gather(self, pool: Tensor, gather: Tensor, buf: str) -> Tensor:
        n, hd = gather.shape[0], pool.shape[-1]
        if getattr(self, buf).numel() < n * hd:
            setattr(self, buf, None)  # let the old buffer go before the new one is taken
            setattr(self, buf, pool.new_empty(n * hd + n * hd // 4))
        # the layer's attention reads it before the next layer's update() overwrites it
        out = getattr(self, buf)[:n * hd].view(n, hd)
        torch.index_select(pool, 0, gather, out=out)
        return out

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        B, H, T, hd = k.shape
        gather = self._write(layer, k, v)
        tk = gather.shape[0] // (B * H)
        ko, vo = self._gather(self.k[layer], gather, "_kbuf"), self._gather(self.v[layer], gather, "_vbuf")
        return ko.view(B, H, tk, hd), vo.view(B, H, tk, hd)  # (B, H, length + T, hd), contiguous

    def step_update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor | PoolRows]:
        """update() for MultiHeadAttention.step. One new token per sequence on the CPU (float32): the keys come
        back gathered, the values stay in the pool (PoolRows; the attention takes probs @ V with
        PoolRows.weighted_sum). A decoding step's time on the CPU is mostly memory traffic over the cached
        keys/values, and this saves the copy of the values (benchmarks/serve.py). Otherwise: update()."""
        B, H, T, hd = k.shape
        if T != 1 or self.k.device.type != "cpu" or self.k.dtype != torch.float32:
            return self.update(layer, k, v)
        gather = self._write(layer, k, v)
        tk = gather.shape[0] // (B * H)
        ko = self._gather(self.k[layer], gather, "_kbuf")
        return ko.view(B, H, tk, hd), PoolRows(self.v[layer], gather.view(B * H, tk))

    def advance(self, n: int) -> None:
        for s in self.active:
            self.lens[s] += n
        self._lens_t = self._lens_t + n
        self.length += n
        self._plan = None

    def reorder(self, index: Tensor) -> None:
        raise NotImplementedError("the paged cache serves independent requests; use StaticCache for beams")
