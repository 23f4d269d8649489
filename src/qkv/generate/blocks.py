"""The Engine's KV block manager: which cache blocks each request holds, and the prefix cache over them.

The blocks themselves (allocation, reference counts, least-recently-used eviction of cached blocks, the
copy-on-write of a shared last block) are nn/paged.py's PagedKVCache and BlockAllocator; this module is what
the scheduler asks of them: how many blocks a request still needs, which of its leading full blocks some
earlier sequence already computed (same tokens from position 0: a chain of content hashes), and putting a
request's newly filled blocks into that cache. A block holding image placeholders hashes the keys of those
images too (`extra`, images.py's block_extras): the same placeholder ids with another image never match.
"""

from __future__ import annotations

import hashlib
from typing import Any

from qkv.nn.paged import block_digest


def block_key(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    """A full block's prefix-cache key: the chained token digest, hashed once more with the block's image
    keys when it has some (its own domain, so no text-only chain can produce it)."""
    d = block_digest(parent, tokens)
    return hashlib.sha256(b"images:" + d + extra).digest() if extra else d


class BlockManager:
    def __init__(self, cache: Any, prefix_caching: bool = True) -> None:
        self.cache = cache  # a PagedKVCache (the model's make_paged_cache)
        self.allocator = cache.allocator
        self.block_size: int = cache.block_size
        self.prefix_caching = prefix_caching
        # blocks kept free for the running requests' next tokens while another is admitted
        self.watermark = max(1, self.allocator.num_blocks // 100)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def head(self, prompt: list[int], extra: dict[int, bytes] | None = None) -> bytes:
        """The prefix-cache key of a prompt's first block (b"": shorter than a block)."""
        bs = self.block_size
        return block_key(b"", prompt[:bs], (extra or {}).get(0, b"")) if len(prompt) >= bs else b""

    def cached_prefix(self, tokens: list[int], extra: dict[int, bytes] | None = None
                      ) -> tuple[list[int], list[bytes]]:
        """The leading full blocks of tokens found in the prefix cache, and their keys (extra: the image
        keys of blocks holding placeholders)."""
        if not self.prefix_caching:
            return [], []
        bs = self.block_size
        blocks: list[int] = []
        digests: list[bytes] = []
        parent = b""
        for i in range(len(tokens) // bs):
            parent = block_key(parent, tokens[i * bs:(i + 1) * bs], (extra or {}).get(i, b""))
            b = self.allocator.lookup(parent)
            if b is None:
                break
            blocks.append(b)
            digests.append(parent)
        return blocks, digests

    def admission(self, n: int, blocks: list[int], others_running: bool) -> tuple[int, int, int]:
        """(hit, need, free) for a sequence of n tokens whose first len(blocks) blocks are cached: the tokens
        it need not compute, the blocks it takes to compute the rest, and the blocks free for it."""
        bs, alloc = self.block_size, self.allocator
        hit = min(len(blocks) * bs, n - 1)  # the last token is always fed: its logits are needed
        need = -(-n // bs) - len(blocks) + (1 if hit < len(blocks) * bs else 0)  # + the copy-on-write
        revived = sum(1 for b in blocks if alloc.ref_count(b) == 0)  # cached blocks stop being free
        free = alloc.num_free - revived - (self.watermark if others_running else 0)
        return hit, need, free

    def allocate(self, seq_id: int, blocks: list[int], hit: int) -> None:
        """Start a sequence on its shared prefix blocks, hit tokens of them already computed."""
        self.cache.add_sequence(seq_id, blocks)
        if hit < len(blocks) * self.block_size:
            self.cache.set_length(seq_id, hit)

    def reserve(self, seq_id: int, n: int) -> bool:
        """Blocks for n more tokens of a sequence; False when the pool is short."""
        return self.cache.reserve(seq_id, n)

    def fork(self, parent: int, child: int) -> None:
        """child starts on all of parent's blocks (shared; copied on their first write)."""
        self.cache.fork(parent, child)

    def free(self, seq_id: int) -> None:
        self.cache.free_sequence(seq_id)

    def holds_blocks(self, seq_id: int) -> bool:
        return bool(self.cache.tables[seq_id])

    def register(self, seq_id: int, tokens: list[int], computed: int, digests: list[bytes],
                 extra: dict[int, bytes] | None = None) -> None:
        """Put a sequence's newly filled blocks (of its first `computed` tokens) into the prefix cache;
        digests, the keys of its blocks registered so far, grows in place."""
        if not self.prefix_caching:
            return
        bs, table, extra = self.block_size, self.cache.tables[seq_id], extra or {}
        while len(digests) < computed // bs:
            i = len(digests)
            d = block_key(digests[-1] if digests else b"", tokens[i * bs:(i + 1) * bs], extra.get(i, b""))
            self.allocator.register(table[i], d)
            digests.append(d)
