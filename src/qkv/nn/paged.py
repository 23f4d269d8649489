"""A paged KV cache: fixed-size blocks from one shared pool, a block table per sequence.

The static cache gives every sequence of a batch max_len positions; requests of very different lengths then
waste most of it. Here the pool holds num_blocks blocks of block_size positions (per layer, per kv head),
a sequence owns a list of block ids (its block table) and asks for a new block only when its last one is
full, so it wastes at most block_size - 1 positions. Blocks go back to the free pool when it finishes.
(The idea of vLLM's PagedAttention, Kwon et al. 2023, written with plain tensor indexing.)

Sharing. Blocks are reference-counted: sequences that start with the same tokens can point their tables at
the same full blocks (the prefix cache of BlockAllocator, keyed by block_digest: nn/block_pool.py). A
shared block, or one the prefix cache holds, is never written: a write that would land in it copies it first
(copy-on-write), which happens when a sequence recomputes the last token of a fully cached prompt.

Layout and one step. The value pool is (n_layers, H_kv * num_blocks * block_size, hd): row h * slots + s
holds head h of slot s = block * block_size + i. The key pool keeps each block TRANSPOSED: (n_layers,
H_kv * num_blocks * hd, block_size), row (h * num_blocks + block) * hd + d holds dimension d of the block's
block_size keys, so q @ K^T of one block is a weighted sum of hd pool rows (see PoolKeys). Each step serves
the *active* sequences (set_active). update() writes the new keys/values of every active sequence into their
slots (one index_copy_ each), then gathers each sequence's keys/values RIGHT-aligned into a contiguous
(B, H_kv, max_len + T, hd): sequence b's last key sits in the last column for every b, exactly like a
left-padded static cache. So the causal mask and ALiBi's bias (both bottom-right aligned) need nothing
special; keep_mask() hides the unused left part, and offset gives each sequence its own positions.
The write/gather indices are computed once per step (first layer) and reused by every layer, and the
gathered keys/values go into two buffers the cache keeps (every layer of every step reuses them): a fresh
tensor of that size per layer cost ~4x the copy itself on CPU (page faults of newly mapped memory).
The decoding step (step_update, one token per sequence, CPU float32/64) gathers nothing: the scores and the
weighted sum of the values are read from the pools (PoolKeys, PoolRows).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.nn.block_pool import BlockAllocator, block_digest
from qkv.nn.cache import KVCache

__all__ = ["BlockAllocator", "PagedKVCache", "PoolKeys", "PoolRows", "block_digest"]


class _ValueBags:
    """The index tensors of one decoding step's probs @ V over the real (unmasked) columns only, made once
    per query-group size and reused by every layer of the step: one bag per (batch-head r, query head g),
    holding the value pool rows of r's real columns; `weights` picks those columns' probabilities. Built
    with ragged aranges (repeat_interleave), not boolean masks: a mask over (B, H, G, tk) took ~10 ms."""

    def __init__(self, rows: Tensor, real: Tensor, total: int, tk: int) -> None:
        # rows: (B * H * tk,) right-aligned value rows; real: (B,) real columns of each sequence; total: sum
        self.rows, self.real, self.total = rows.view(real.shape[0], -1, tk), real, total
        self._by_group: dict[int, tuple[Tensor, Tensor, Tensor]] = {}

    def group(self, G: int) -> tuple[Tensor, Tensor, Tensor]:
        """(rows (n_real,) pool rows in (b, h, g, t) order, offsets (B * H * G,) first row of each bag,
        weights (n_real,) indices into the flattened (B * H, G, tk) probs)."""
        if G not in self._by_group:
            B, H, tk = self.rows.shape
            per_bag = self.real.repeat_interleave(H * G)  # (B * H * G,) real columns of each bag
            offsets = torch.cumsum(per_bag, 0) - per_bag
            n = self.total * H * G
            bag = torch.repeat_interleave(torch.arange(B * H * G, device=per_bag.device), per_bag,
                                          output_size=n)
            col = torch.arange(n, device=per_bag.device) + (tk - per_bag - offsets).index_select(0, bag)
            rows = self.rows.reshape(-1).index_select(0, torch.div(bag, G, rounding_mode="floor") * tk + col)
            self._by_group[G] = (rows, offsets, bag * tk + col)
        return self._by_group[G]


class PoolRows(NamedTuple):
    """A decoding step's values left in the pool (PagedKVCache.step_update): row index[i, t] of `pool` (one
    layer's (H_kv * slots, hd) values) is key column t of batch-head i. weighted_sum(probs) is probs @ V
    computed straight from the pool by one embedding_bag (a weighted sum of rows), instead of gathering V
    into a contiguous copy and multiplying: one read of the values instead of a read, a write and a read.
    With `real` (one token per sequence), only the real columns' rows are summed, not the padding ones."""

    pool: Tensor
    index: Tensor  # (B * H_kv, Tk) pool rows
    real: _ValueBags | None = None

    def weighted_sum(self, probs: Tensor) -> Tensor:
        """probs: (B * H_kv, G * T, Tk) attention weights (G query heads per key/value head) ->
        (B * H_kv, G * T, hd)."""
        n, q, tk = probs.shape
        if self.real is not None:  # q = G query heads of one token; the masked columns' weights are 0
            rows, offsets, weights = self.real.group(q)
            w = probs.reshape(-1).index_select(0, weights)
            return F.embedding_bag(rows, self.pool, offsets, mode="sum", per_sample_weights=w).view(n, q, -1)
        idx = self.index if q == 1 else self.index.unsqueeze(1).expand(n, q, tk).reshape(n * q, tk)
        out = F.embedding_bag(idx, self.pool, mode="sum", per_sample_weights=probs.reshape(n * q, tk))
        return out.view(n, q, -1)


class _KeyBags:
    """The index tensors of one decoding step's q @ K^T from the transposed key pool (PagedKVCache, first
    layer), made once per query-group size and reused by every layer of the step.

    A bag is one (batch-head r, block j of its sequence, query head g of the group): the hd pool rows of the
    block (one per key dimension d) weighted by q[r, g, d] sum to the block's block_size scores. Only the
    blocks a sequence holds are bags (no padding). `cols` then picks each batch-head's scores out of the
    bags' results RIGHT-aligned, as update() lays out the keys (masked columns read its position 0)."""

    def __init__(self, blocks: Tensor, count: Tensor, pos: Tensor, hd: int, bs: int) -> None:
        # blocks: (B, H, width) pool block rows (h * num_blocks + block), count: (B,) blocks per sequence,
        # pos: (B, tk) position of each right-aligned column (clamped to >= 0)
        B, H, width = blocks.shape
        real = (torch.arange(width, device=blocks.device) < count.unsqueeze(1)).unsqueeze(1)
        real = real.expand(B, H, width)
        self.base = blocks[real] * hd  # (n_blocks,) first pool row of each real block, (b, h, j) order
        r = torch.arange(B * H, device=blocks.device).view(B, H, 1).expand(B, H, width)
        self.r = r[real]  # (n_blocks,) the batch-head of each block
        per_r = count.repeat_interleave(H)  # (B * H,) blocks of each batch-head
        self.start = torch.cumsum(per_r, 0) - per_r  # first block of each batch-head
        self.pos = pos  # (B, tk)
        self.hd, self.bs = hd, bs
        self._by_group: dict[int, tuple[Tensor, Tensor, Tensor]] = {}

    def group(self, G: int) -> tuple[Tensor, Tensor, Tensor]:
        """(bags (n_blocks * G, hd) pool rows, rows (n_blocks * G,) query rows of q.view(B * H * G, hd),
        cols (B * H, G, tk) indices into the bags' flattened (n_blocks * G * block_size) results)."""
        if G not in self._by_group:
            dev, bs = self.base.device, self.bs
            g = torch.arange(G, device=dev)
            bags = (self.base.unsqueeze(1) + torch.arange(self.hd, device=dev)).repeat_interleave(G, 0)
            rows = (self.r.unsqueeze(1) * G + g).reshape(-1)
            # column t of (r, g) is element i of bag (start[r] + j) * G + g, for position j * bs + i
            B, tk = self.pos.shape
            u = torch.div(self.pos, bs, rounding_mode="floor") * (G * bs) + self.pos % bs  # (B, tk)
            first = self.start.view(B, -1, 1, 1) * (G * bs) + g.view(1, 1, G, 1) * bs  # (B, H, G, 1)
            cols = (first + u.view(B, 1, 1, tk)).view(-1, G, tk)
            self._by_group[G] = (bags, rows, cols)
        return self._by_group[G]


class PoolKeys(NamedTuple):
    """A decoding step's keys left in the pool (PagedKVCache.step_update). scores(q) is q @ K^T over every
    active sequence's keys, right-aligned as update() would have gathered them, computed straight from the
    transposed key pool by one embedding_bag (per block: hd rows of block_size keys weighted by q's hd
    values), instead of gathering K into a contiguous copy and multiplying: one read of the keys instead of a
    read, a write and a read, and none of the padding columns of the shorter sequences."""

    pool: Tensor  # one layer's keys, (H_kv * num_blocks * hd, block_size)
    bags: _KeyBags

    def scores(self, q: Tensor) -> Tensor:
        """q: (B * H_kv, G, hd) queries (one token, G query heads per key/value head) -> (B * H_kv, G, tk)."""
        n, G, hd = q.shape
        bags, rows, cols = self.bags.group(G)
        w = q.reshape(n * G, hd).index_select(0, rows)  # (n_blocks * G, hd)
        out = F.embedding_bag(bags, self.pool, mode="sum", per_sample_weights=w)  # (n_blocks * G, block_size)
        return out.view(-1).index_select(0, cols.view(-1)).view(n, G, -1)


class _Plan:
    """One step's indices, made by the first layer and used by every layer: value rows to write and to
    gather (B * H * T,), (B * H * tk,); key pool elements to write; and, made on first use, the keys' element
    gather (update) or their bags (step_update)."""

    def __init__(self, write: Tensor, gather: Tensor, key_write: Tensor, gather_slots: Tensor, blocks: Tensor,
                 count: Tensor, pos: Tensor, real: Tensor) -> None:
        self.write, self.gather, self.key_write, self.gather_slots = write, gather, key_write, gather_slots
        # (B, H, width) key blocks, (B,) blocks in use, (B, tk) positions
        self.blocks, self.count, self.pos = blocks, count, pos
        self.real = real  # (B,) real columns of each sequence
        self.key_gather: Tensor | None = None
        self.key_bags: _KeyBags | None = None
        self.value_bags: _ValueBags | None = None


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
        # values (layer, head * slot, hd): the rows of one step's gather come out as (B, H, tk, hd),
        # contiguous, which is what attention's batched matmul reads (no second copy of the gathered values);
        # keys (layer, (head * block) * hd + d, block_size): each block transposed (PoolKeys)
        # not zeroed: a step reads only written slots, and slot 0 for the masked (padding) columns, which is
        # zeroed here so that a masked key/value is finite (softmax weight 0 x NaN would be NaN). Zeroing a
        # pool sized for max_batch_size x context (GBs) took seconds per Engine; untouched pages cost nothing.
        kw = dict(dtype=dtype, device=device)
        self.k = torch.empty(n_layers, n_kv_heads * num_blocks * head_dim, block_size, **kw)
        self.v = torch.empty(n_layers, n_kv_heads * num_blocks * block_size, head_dim, **kw)
        self.k.view(n_layers, n_kv_heads, num_blocks, head_dim, block_size)[:, :, 0, :, 0] = 0
        self.v.view(n_layers, n_kv_heads, num_blocks * block_size, head_dim)[:, :, 0] = 0
        self.n_kv_heads = n_kv_heads
        self._init_blocks(num_blocks, block_size)
        # one step's gathered keys/values, reused by every layer and step (grown when a step needs more)
        self._kbuf = torch.empty(0, dtype=dtype, device=device)
        self._vbuf = torch.empty(0, dtype=dtype, device=device)

    def _init_blocks(self, num_blocks: int, block_size: int) -> None:
        """The block tables and lengths (everything but the pools, which self.k / self.v already are)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.slots, self.num_blocks = num_blocks * block_size, num_blocks
        self.device = self.k.device
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.active: list[int] = []
        self._lens_t = torch.zeros(0, dtype=torch.long, device=self.device)
        self._plan: _Plan | None = None
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

    def fork(self, parent: int, child: int) -> None:
        """A new sequence `child` holding every block and position of `parent` (one more reference each): the
        first write into a shared block copies it (copy-on-write), so parallel samples of one prompt share
        its keys/values."""
        if child in self.tables:
            raise ValueError(f"sequence {child} is already in the cache")
        for b in self.tables[parent]:
            self.allocator.share(b)
        self.tables[child], self.lens[child] = list(self.tables[parent]), self.lens[parent]

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

    def truncate(self, seq_id: int, n: int) -> None:
        """Forget all but the first n cached positions of a sequence and give back the blocks past them
        (speculative decoding's rejected drafts: written, never to be read)."""
        self.set_length(seq_id, n)
        table = self.tables[seq_id]
        keep = -(-n // self.block_size)
        if len(table) > keep:
            self.allocator.free(table[keep:][::-1])
            del table[keep:]

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
            self._copy_block(old, new)
            table[i] = new
            self.allocator.free([old])
            self.copies += 1
        need = -(-(n + new_tokens) // bs)
        while len(table) < need:
            table.append(self.allocator.allocate())

    def _copy_block(self, old: int, new: int) -> None:
        """Every layer's keys and values of block `old` into block `new`."""
        bs = self.block_size
        heads = self.v.view(self.v.shape[0], self.n_kv_heads, self.slots, -1)
        heads[:, :, new * bs:(new + 1) * bs] = heads[:, :, old * bs:(old + 1) * bs]
        blocks = self.k.view(self.k.shape[0], self.n_kv_heads, self.num_blocks, -1)  # a block's hd x bs keys
        blocks[:, :, new] = blocks[:, :, old]

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
    def step_reads_in_place(self) -> bool:
        """Whether step_update() leaves the keys/values in the pool (PoolKeys, PoolRows): CPU, float32/64."""
        return self.k.device.type == "cpu" and self.k.dtype in (torch.float32, torch.float64)

    @property
    def blocks_in_use(self) -> int:
        return self.allocator.num_used

    @property
    def bytes_per_block(self) -> int:
        L, _, hd = self.v.shape
        return 2 * L * self.block_size * self.n_kv_heads * hd * self.k.element_size()

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one position of one sequence takes, over all layers."""
        return self.bytes_per_block // self.block_size

    # -- KVCache ----------------------------------------------------------------------------------------
    def _slots(self, T: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The step's slots (slot = block * block_size + i), each active sequence's table first grown to hold
        T more positions (if reserve() did not): tables (B, width) block ids; write (B, T) slots of the new
        tokens; gather (B, tk) slots of every key RIGHT-aligned (column t of row b holds position
        t - (length - len_b); masked columns read slot 0); pos (B, tk) those positions, clamped to >= 0."""
        bs = self.block_size
        for s in self.active:
            self._grow(s, T)
        width = max(len(self.tables[s]) for s in self.active)
        tables = torch.tensor([self.tables[s] + [0] * (width - len(self.tables[s])) for s in self.active],
                              dtype=torch.long, device=self.device)
        lens = self._lens_t.unsqueeze(1)
        p = lens + torch.arange(T, device=self.device)  # positions len .. len + T - 1
        write = tables.gather(1, p // bs) * bs + p % bs
        p = torch.arange(self.length + T, device=self.device).unsqueeze(0) - (self.length - lens)
        valid = p >= 0
        p = p.clamp_min(0)
        return tables, write, torch.where(valid, tables.gather(1, p // bs) * bs + p % bs, 0), p

    def _make_plan(self, T: int) -> _Plan:
        tables, write, gather, p = self._slots(T)
        # rows of the (head * slot) value pool, in (B, H, T) and (B, H, tk) order
        head = (torch.arange(self.n_kv_heads, device=self.device) * self.slots).view(1, -1, 1)
        blocks = tables.unsqueeze(1) + (head // self.block_size)  # (B, H, width) key pool (head * block) rows
        return _Plan((head + write.unsqueeze(1)).reshape(-1), (head + gather.unsqueeze(1)).reshape(-1),
                     self._key_elements(write), gather, blocks, -(-(self._lens_t + T) // self.block_size), p,
                     self._lens_t + T)

    def _key_elements(self, slots: Tensor) -> Tensor:
        """(B, n) slots -> (B * H * n * hd,) elements of one layer's flattened key pool, in (B, H, n, hd)
        order."""
        bs, hd = self.block_size, self.v.shape[-1]
        head = torch.arange(self.n_kv_heads, device=self.device).view(1, -1, 1) * (self.num_blocks * hd * bs)
        first = head + (slots // bs * (hd * bs) + slots % bs).unsqueeze(1)  # (B, H, n): element of d = 0
        return (first.unsqueeze(-1) + torch.arange(hd, device=self.device) * bs).reshape(-1)

    def _write(self, layer: int, k: Tensor, v: Tensor) -> _Plan:
        """Write the active sequences' new keys/values into their slots; returns the step's plan."""
        B, H, T, hd = k.shape
        if B != len(self.active):
            raise ValueError(f"the batch has {B} rows but {len(self.active)} sequences are active")
        if self._plan is None:
            self._plan = self._make_plan(T)
        plan = self._plan
        self.k[layer].view(-1).index_copy_(0, plan.key_write, k.reshape(-1))
        self.v[layer].index_copy_(0, plan.write, v.reshape(B * H * T, hd))
        return plan

    def _gather(self, pool: Tensor, gather: Tensor, hd: int, buf: str) -> Tensor:
        n = gather.shape[0]
        if getattr(self, buf).numel() < n * hd:
            setattr(self, buf, None)  # let the old buffer go before the new one is taken
            setattr(self, buf, pool.new_empty(n * hd + n * hd // 4))
        # the layer's attention reads it before the next layer's update() overwrites it
        out = getattr(self, buf)[:n * hd]
        torch.index_select(pool, 0, gather, out=out.view(n, -1) if pool.dim() == 2 else out)
        return out.view(n, -1)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        B, H, T, hd = k.shape
        plan = self._write(layer, k, v)
        if plan.key_gather is None:  # elements of the transposed key pool, right-aligned (B, H, tk, hd)
            plan.key_gather = self._key_elements(plan.gather_slots)
        tk = plan.gather.shape[0] // (B * H)
        ko = self._gather(self.k[layer].view(-1), plan.key_gather, 1, "_kbuf")
        vo = self._gather(self.v[layer], plan.gather, hd, "_vbuf")
        return ko.view(B, H, tk, hd), vo.view(B, H, tk, hd)  # (B, H, length + T, hd), contiguous

    def step_update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor | PoolKeys, Tensor | PoolRows]:
        """update() for MultiHeadAttention.step. One new token per sequence on the CPU (float32 or 64): the
        keys and values stay in the pool (PoolKeys, PoolRows: the attention takes q @ K^T with
        PoolKeys.scores and probs @ V with PoolRows.weighted_sum). A decoding step's time on the CPU is mostly
        memory traffic over the cached keys/values, and this saves copying them (benchmarks/serve.py).
        Otherwise: update()."""
        B, H, T, hd = k.shape
        if T != 1 or not self.step_reads_in_place:
            return self.update(layer, k, v)
        plan = self._write(layer, k, v)
        if plan.key_bags is None:
            plan.key_bags = _KeyBags(plan.blocks, plan.count, plan.pos, hd, self.block_size)
        tk = plan.gather.shape[0] // (B * H)
        if plan.value_bags is None:
            # int(): on the CPU, no device sync
            plan.value_bags = _ValueBags(plan.gather, plan.real, int(plan.real.sum()), tk)
        return PoolKeys(self.k[layer], plan.key_bags), PoolRows(self.v[layer], plan.gather.view(B * H, tk),
                                                                  plan.value_bags)

    def advance(self, n: int) -> None:
        for s in self.active:
            self.lens[s] += n
        self._lens_t = self._lens_t + n
        self.length += n
        self._plan = None

    def reorder(self, index: Tensor) -> None:
        raise NotImplementedError("the paged cache serves independent requests; use StaticCache for beams")
