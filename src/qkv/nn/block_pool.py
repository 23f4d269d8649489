"""The block pool of the paged KV cache (nn/paged.py): which blocks are free, who references each, and the
prefix cache that finds a full block again by the tokens it holds (vLLM's automatic prefix caching)."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


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


def block_digest(parent: bytes, tokens: list[int]) -> bytes:
    """The prefix-cache key of a full block: a SHA-256 chained over the previous block's key, so a block is
    found only after exactly the same tokens from position 0 (its keys/values depend on all of them)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()
