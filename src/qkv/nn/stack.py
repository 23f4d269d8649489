"""A stack of blocks: the encoder and the decoder of every family.

It receives embeddings (B, T, d_model) from any front end (tokens, image patches, audio frames), adds
positions through the positional-encoding hooks, runs the blocks and the final norm (Pre-LN only).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from qkv.nn.attention import Unpadded, expand_mask, step_scores_bias
from qkv.nn.block import Block
from qkv.nn.cache import ColumnWrites, KVCache, StaticCache
from qkv.nn.norm import build_norm, frozen_running_stats
from qkv.nn.position import PositionalEncoding


@dataclass
class StackOutput:
    hidden: Tensor  # (B, T, d_model)
    # per layer {"self"|"cross": (B,H,T,Tk)}
    attentions: list[dict[str, Tensor]] = field(default_factory=list)


class Stack(nn.Module):
    def __init__(
        self,
        blocks: list[Block],
        position: PositionalEncoding,
        *,
        d_model: int,
        final_norm: bool,
        norm: str = "layernorm",
        norm_eps: float = 1e-5,
        bias: bool = True,
        embed_norm: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.position = position
        self.embed_norm = build_norm(norm, d_model, norm_eps, bias) if embed_norm else None
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = build_norm(norm, d_model, norm_eps, bias) if final_norm else None
        self.causal = blocks[0].attn.causal if blocks else False
        self.gradient_checkpointing = False

    @property
    def context_limit(self) -> int | None:
        """The most positions this stack takes: an absolute table's length, None for RoPE / ALiBi / none."""
        return self.position.max_len

    @staticmethod
    def _last_position(offset: int | Tensor, T: int, k_len: int) -> int:
        """A Python-int bound on the positions a forward uses, known without a device sync. A per-row
        offset counts the real tokens before x in its row, so it is at most the cached length and every
        position is below k_len = cached + T (left-padded batches, the paged cache)."""
        return offset + T if isinstance(offset, int) else k_len

    def forward(
        self,
        x: Tensor,
        *,
        keep: Tensor | None = None,
        memory: Tensor | None = None,
        memory_keep: Tensor | None = None,
        offset: int | Tensor | None = None,
        cache: KVCache | None = None,
        return_weights: bool = False,
        unpad: bool = False,
        last_only: bool = False,
    ) -> StackOutput:
        """x: (B, T, d) embeddings. keep: (B, Tk) bool, real (non-pad) keys, Tk = cached + T.
        memory/memory_keep: encoder output (B, S, d) and its (B, S) keep-mask. offset: position of x[:, 0]
        (defaults to the cache's length). Returns the final hidden states and, optionally, the weights.
        unpad=True (a self-attention stack without cache or memory, with padding in `keep`): the blocks run
        their token-wise layers on the real tokens only (attention.Unpadded) and the hidden states of the
        padded positions come back as zeros instead of values nothing should read; the real tokens' are the
        same function. Ignored under torch.compile (the number of real tokens is data-dependent).
        last_only=True: only the last position's hidden state is wanted (B, 1, d) (a prefill before
        generation): the top block computes keys and values for every position and the rest of its work for
        the last position only. Ignored with return_weights or unpad (the hidden states are then (B, T,
        d))."""
        B, T, _ = x.shape
        if offset is None:
            offset = cache.offset if cache is not None else 0
        if self.gradient_checkpointing and self.training and cache is not None:
            raise ValueError("gradient checkpointing cannot be combined with a KV cache (HF #21737)")
        k_len = (cache.length if cache is not None else 0) + T
        if keep is not None and tuple(keep.shape) != (B, k_len):
            raise ValueError(f"attention mask has shape {tuple(keep.shape)} but the keys are (batch {B}, "
                             f"{k_len} = cached + new positions)")
        if memory_keep is not None and memory is not None and memory_keep.shape != memory.shape[:2]:
            raise ValueError(f"memory mask has shape {tuple(memory_keep.shape)} but the memory is "
                             f"{tuple(memory.shape[:2])} (batch, source length)")
        self.position.reserve(self._last_position(offset, T, k_len))
        if cache is not None and memory is not None:
            cache.memory_keep = memory_keep  # kept with the cross K/V for the decoding step
        x = self.position.embed(x, offset)
        if self.embed_norm is not None:
            x = self.embed_norm(x, None if keep is None else keep[:, -T:])
        x = self.drop(x)
        bias = self.position.bias(T, k_len, self.causal)
        mask = None if keep is None else expand_mask(keep)
        mem_mask = None if memory_keep is None else expand_mask(memory_keep)
        tok_keep = None if keep is None else keep[:, -T:]
        unpadded = None
        if (unpad and keep is not None and cache is None and memory is None
            and not torch.compiler.is_compiling()):
            u = Unpadded.from_keep(tok_keep.bool())
            if u.index.numel() < B * T:  # nothing to skip otherwise
                unpadded, x, tok_keep = u, u.unpad(x), None  # the rows are all real: no keep for the norms
        attentions = []
        last = len(self.blocks) - 1 if last_only and not return_weights and unpadded is None else -1
        for i, block in enumerate(self.blocks):
            kwargs = dict(mask=mask, bias=bias, keep=tok_keep, memory=memory, memory_mask=mem_mask,
                          position=self.position, offset=offset, cache=cache, layer=i,
                          return_weights=return_weights, unpadded=unpadded)
            if i == last:
                kwargs["last_only"] = True
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                # the recomputation in backward must not update BatchNorm's running statistics again
                x, w = checkpoint(lambda h, blk=block, kw=kwargs: blk(h, **kw), x, use_reentrant=False,
                                  context_fn=lambda: (nullcontext(), frozen_running_stats()))
            else:
                x, w = block(x, **kwargs)
            if return_weights:
                attentions.append(w)
        if cache is not None:
            cache.advance(T)
        if last >= 0 and tok_keep is not None:
            tok_keep = tok_keep[:, -1:]
        if self.final_norm is not None:
            x = self.final_norm(x, tok_keep)
        if unpadded is not None:
            x = unpadded.pad(x)
        return StackOutput(x, attentions)

    def step(
        self,
        x: Tensor,
        *,
        cache: KVCache,
        keep: Tensor | None = None,
        offset: int | Tensor | None = None,
        last_only: bool = False,
    ) -> Tensor:
        """The decoding step: forward() for the few newest tokens over a filled cache, for inference.

        x: (B, T, d) embeddings of the T newest tokens (T = 1 for one token; a small chunk works too); keep:
        (B, cached + T) bool key mask (None: every key is real); offset: position of x[:, 0] (default the
        cache's). Returns the final hidden states (B, T, d) and advances the cache by T. Cross-attention (an
        encoder-decoder's decoder) reads the encoder K/V and their mask from the cache, which the first,
        prefilling forward() filled. The position bias, the key padding and the causal mask among the new
        tokens are folded into one additive term per step (step_scores_bias), shared by every layer. No
        dropout and no attention weights: use forward() for those. last_only=True: only the last token's
        hidden state is wanted, (B, 1, d): the top block caches every token's keys/values but computes the
        rest (its attention's queries, output projection, feed-forward) for the last token only, as forward's
        last_only (a prefill chunk of T tokens saves ~(T - 1) / T of that work; decoder-only stacks: with
        cross-attention every token goes through)."""
        if self.training:
            raise RuntimeError("Stack.step is the inference path (no dropout): call model.eval() first")
        B, T, _ = x.shape
        if offset is None:
            offset = cache.offset
        k_len = cache.length + T
        if keep is not None and tuple(keep.shape) != (B, k_len):
            raise ValueError(f"attention mask has shape {tuple(keep.shape)} but the keys are (batch {B}, "
                             f"{k_len} = cached + new positions)")
        self.position.reserve(self._last_position(offset, T, k_len))
        tok_keep = None if keep is None else keep[:, -T:]
        x = self.position.embed(x, offset)
        if self.embed_norm is not None:
            x = self.embed_norm(x, tok_keep)
        add = cross_add = None
        if self.blocks:
            a = self.blocks[0].attn
            heads = dict(batch=B, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, q_len=T, dtype=x.dtype,
                         device=x.device)
            add = step_scores_bias(**heads, k_len=k_len, bias=self.position.bias(T, k_len, self.causal),
                                   keep=keep, causal=self.causal)
            if self.blocks[0].cross is not None and cache.memory_keep is not None:
                cross_add = _cross_scores_bias(heads, cache.memory_keep)
        # the blocks work on the new tokens' rows: one product per linear
        rows = x.reshape(B * T, x.shape[-1])
        row_keep = None if tok_keep is None else tok_keep.reshape(B * T)
        # only an encoding that rotates (RoPE) is handed to the attention layers; the others did their work
        # above
        rotating = self.position if type(self.position).rotate is not PositionalEncoding.rotate else None
        top = len(self.blocks) - 1 if last_only and T > 1 and cross_add is None and self.blocks \
            and self.blocks[0].cross is None else -1
        for i, block in enumerate(self.blocks):
            rows = block.step(rows, B, cache, i, add, cross_add, row_keep, rotating, offset, i == top)
        cache.advance(T)
        if top >= 0:  # the top block returned the last token's rows
            T, row_keep = 1, None if row_keep is None else row_keep.view(B, -1)[:, -1]
        if self.final_norm is not None:
            rows = self.final_norm(rows, row_keep)
        return rows.view(B, T, -1)

    @property
    def static_step_supported(self) -> bool:
        """static_step needs positions that are not an attention bias: ALiBi's and T5's bias depend on the
        query's position as a Python int (the bias hook's q_len/k_len), which a static-shape step does not
        have."""
        return type(self.position).bias is PositionalEncoding.bias

    def static_step(
        self,
        x: Tensor,
        *,
        cache: StaticCache,
        index: Tensor,
        offset: Tensor,
        keep: Tensor | None = None,
    ) -> Tensor:
        """step() for one new token per row with static shapes, for torch.compile and CUDA graphs
        (mode="reduce-overhead"): the same function, computed over every column of the cache.

        x: (B, 1, d) embeddings of the newest tokens; index: (1,) long tensor on the cache's device, the
        column their K/V are written to (= the tokens already cached); offset: (1,) or (B,) long tensor, the
        new token's position (index minus the row's left padding); keep: (B, max_len) bool key mask, or None.
        Attention runs over all max_len columns with the ones after `index` masked (-inf, so a weight of
        exactly 0), so no shape depends on the position and nothing is read back to the host: one compiled
        graph serves every step. Returns (B, 1, d); cache.length is NOT advanced (the caller does, outside the
        graph)."""
        if self.training:
            raise RuntimeError("Stack.static_step is the inference path (no dropout): call model.eval() "
                               "first")
        if not self.static_step_supported:
            raise ValueError(f"static_step does not support {type(self.position).__name__} positions (an "
                             f"attention bias that depends on the query position): use step()")
        B, T, d = x.shape
        if T != 1:
            raise ValueError(f"static_step takes one new token per row, got {T}")
        L = cache.max_len
        # a Python int: grows RoPE's table before tracing, refuses past a fixed table
        self.position.reserve(L)
        x = self.position.embed(x, offset)
        if self.embed_norm is not None:
            x = self.embed_norm(x, None)
        visible = torch.arange(L, device=x.device) <= index  # (L,): the cached columns and the new one
        visible = visible.expand(B, L) if keep is None else keep.bool() & visible
        add = cross_add = None
        if self.blocks:
            a = self.blocks[0].attn
            heads = dict(batch=B, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, q_len=1, dtype=x.dtype,
                         device=x.device)
            add = step_scores_bias(**heads, k_len=L, bias=None, keep=visible, causal=False)
            if self.blocks[0].cross is not None and cache.memory_keep is not None:
                cross_add = _cross_scores_bias(heads, cache.memory_keep)
        rows = x.reshape(B, d)
        writes = ColumnWrites(cache, index)
        rotating = self.position if type(self.position).rotate is not PositionalEncoding.rotate else None
        for i, block in enumerate(self.blocks):
            rows = block.step(rows, B, writes, i, add, cross_add, None, rotating, offset)
        if self.final_norm is not None:
            rows = self.final_norm(rows, None)
        return rows.view(B, 1, -1)


def _cross_scores_bias(heads: dict, memory_keep: Tensor) -> Tensor:
    """The decoding step's additive cross-attention mask from the encoder keep-mask (B0, S). heads: the
    step_scores_bias keywords of the step's B rows. When the encoder K/V are kept once per source for R = B /
    B0 rows each (beam search), the R rows' heads form one group, as in attention._shared_cross_step."""
    B0 = memory_keep.shape[0]
    if B0 != heads["batch"]:
        heads = {**heads, "batch": B0, "n_heads": heads["n_heads"] * (heads["batch"] // B0)}
    return step_scores_bias(**heads, k_len=memory_keep.shape[1], bias=None, keep=memory_keep, causal=False)
