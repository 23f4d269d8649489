"""Key/value caches for incremental decoding, behind one interface.

A decoder layer calls `k, v = cache.update(layer, k_new, v_new)` and attends over what comes back; the
model calls `cache.advance(t)` once all layers have seen the t new tokens. Cross-attention keys/values
(the encoder memory of an encoder-decoder) are projected once and kept with `set_cross`/`get_cross`, beside
the memory's keep-mask (`memory_keep`), so the decoding step (Stack.step) needs nothing but the cache.
`StaticCache` preallocates a (B, H_kv, max_len, hd) pair per layer so a decoding step writes in place and
allocates nothing; the paged cache (qkv.nn.paged) implements the same methods over a pool of blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Interface and the cross-attention store shared by all caches."""

    length: int = 0
    max_len: int | None = None  # positions it can hold (None: grows without a fixed limit)

    def __init__(self) -> None:
        self._cross: dict[int, tuple[Tensor, Tensor]] = {}
        # the encoder memory's keep-mask (B, S), stored with its K/V so a decoding step needs no memory
        self.memory_keep: Tensor | None = None

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:  # pragma: no cover
        raise NotImplementedError

    def advance(self, n: int) -> None:
        self.length += n

    @property
    def offset(self) -> int:
        """Position of the next token to be written."""
        return self.length

    def has_cross(self, layer: int) -> bool:
        return layer in self._cross

    def get_cross(self, layer: int) -> tuple[Tensor, Tensor]:
        return self._cross[layer]

    def set_cross(self, layer: int, k: Tensor, v: Tensor) -> None:
        self._cross[layer] = (k, v)

    def reorder(self, index: Tensor, *, cross: bool = True) -> None:
        """Keep the batch rows in `index` (beam search reorders hypotheses every step). cross=False leaves
        the encoder's K/V and mask as they are: right when every row of `index` reads the same source as the
        row it replaces (the beams of one sentence), which saves copying them at every step."""
        if not cross:
            return
        self._cross = {i: (k.index_select(0, index), v.index_select(0, index))
                           for i, (k, v) in self._cross.items()}
        if self.memory_keep is not None:
            self.memory_keep = self.memory_keep.index_select(0, index)


class StaticCache(KVCache):
    """Preallocated keys and values: per layer a (B, H_kv, max_len, hd) pair, written in place.

    Every layer's pair is a tensor of its own, not a view into one (L, ...) buffer: a compiled step that
    writes a view of a shared buffer writes, once functionalized, the whole buffer, and Inductor copied all L
    layers' cache at every layer's write (a step's cost growing with L squared: the 135M model's compiled
    fp32 step took 53 ms with one buffer, 36 ms with a pair per layer). `k` and `v` stack the pairs into
    (L, B, H_kv, max_len, hd) copies, for reading."""

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        v_head_dim: int | None = None,
    ) -> None:
        """v_head_dim: the width of the values where it differs from the keys' (an MLA latent cache)."""
        super().__init__()
        k_shape = (batch_size, n_kv_heads, max_len, head_dim)
        v_shape = (batch_size, n_kv_heads, max_len, head_dim if v_head_dim is None else v_head_dim)
        self.layers = [(torch.zeros(k_shape, dtype=dtype, device=device),
                        torch.zeros(v_shape, dtype=dtype, device=device)) for _ in range(n_layers)]
        self.max_len = max_len
        self.length = 0

    @property
    def k(self) -> Tensor:
        """Every layer's keys, (L, B, H_kv, max_len, hd): a copy."""
        return torch.stack([k for k, _ in self.layers])

    @property
    def v(self) -> Tensor:
        """Every layer's values, (L, B, H_kv, max_len, hd_v): a copy."""
        return torch.stack([v for _, v in self.layers])

    @property
    def buffers(self) -> list[Tensor]:
        """The tensors the cache writes into (every layer's keys and values)."""
        return [t for pair in self.layers for t in pair]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.buffers)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache is full: {end} positions needed, {self.max_len} allocated")
        kl, vl = self.layers[layer]
        kl.narrow(2, self.length, k.shape[2]).copy_(k)  # narrow: the cheapest slice from Python
        vl.narrow(2, self.length, v.shape[2]).copy_(v)
        return kl.narrow(2, 0, end), vl.narrow(2, 0, end)

    def reset(self) -> None:
        """Empty, for reuse by another generation (the buffers stay where they are: a CUDA graph captured over
        them stays valid). Nothing is zeroed: positions at or past `length` are never attended."""
        self.length = 0
        self._cross = {}
        self.memory_keep = None

    def crop(self, length: int) -> None:
        """Forget every position from `length` on (speculative decoding's rollback of rejected drafts): they
        are never attended again, and the next update overwrites them."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop: length must be in [0, {self.length}], got {length}")
        self.length = length

    def write_at(self, layer: int, k: Tensor, v: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
        """The static-shape update of a graph-captured decoding step (Stack.static_step): k, v (B, H_kv, 1,
        hd) written at column `index` (a (1,) long tensor on the cache's device: the positions already
        cached), and the whole (B, H_kv, max_len, hd) buffers returned; the step masks the columns after
        `index`. Neither the Python `length` nor any tensor value is read, so under torch.compile one graph
        (one CUDA graph) serves every position. `length` is the caller's to advance."""
        kl, vl = self.layers[layer]
        kl.index_copy_(2, index, k)
        vl.index_copy_(2, index, v)
        return kl, vl

    def reorder(self, index: Tensor, *, cross: bool = True) -> None:
        super().reorder(index, cross=cross)
        if index.numel() != self.layers[0][0].shape[0]:  # a new batch size: new buffers
            self.layers = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.layers]
            return
        # the same batch size (beam search): gather only the filled positions into a spare set of buffers and
        # swap them in (the positions past `length` are written before anything reads them). One gather
        # straight into its destination: index_select of the (non-contiguous) filled slice into a new tensor
        # and a copy back took 3-6x longer (Marian-shaped beam search's cache, 1 thread, AVX2). The spare
        # doubles the cache's memory while beams are searched; the layers' tensors are other tensors after a
        # reorder (beam search is never graph-captured: GenerationConfig rejects compile with num_beams > 1).
        n = self.length
        spare = self.__dict__.get("_spare")
        if spare is None or [t.shape for t in spare] != [t.shape for t in self.buffers] or \
                spare[0].dtype != self.layers[0][0].dtype:
            spare = [torch.empty_like(t) for t in self.buffers]
        for src, dst in zip(self.buffers, spare):
            torch.index_select(src.narrow(2, 0, n), 0, index, out=dst.narrow(2, 0, n))
        self._spare = self.buffers
        self.layers = list(zip(spare[0::2], spare[1::2]))


class ColumnWrites:
    """A StaticCache seen by Stack.static_step: `update` writes the new token's K/V at column `index` (a
    device tensor) instead of at the Python `length`, and returns the full buffers; the cross-attention store
    is the cache's own."""

    def __init__(self, cache: StaticCache, index: Tensor) -> None:
        self.cache, self.index = cache, index

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.cache.write_at(layer, k, v, self.index)

    def has_cross(self, layer: int) -> bool:
        return self.cache.has_cross(layer)

    def get_cross(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.cache.get_cross(layer)
