"""Building blocks: they know no model family, no training and no task."""

from qkv.nn.attention import MultiHeadAttention, causal_mask, scaled_dot_product_attention, step_scores_bias
from qkv.nn.block import Block
from qkv.nn.cache import KVCache, StaticCache
from qkv.nn.checks import check_length, check_token_ids
from qkv.nn.ffn import ACTIVATIONS, FeedForward
from qkv.nn.linear import Linear
from qkv.nn.norm import BatchNorm, LayerNorm, RMSNorm, build_norm
from qkv.nn.paged import BlockAllocator, PagedKVCache
from qkv.nn.params import count_parameters, tied_names
from qkv.nn.position import (
    ALiBi,
    FixedTable,
    Learned,
    NoPosition,
    PatchGrid,
    PositionalEncoding,
    RoPE,
    Sinusoidal,
    build_position,
)
from qkv.nn.stack import Stack, StackOutput

__all__ = [
    "ACTIVATIONS", "ALiBi", "BatchNorm", "Block", "BlockAllocator", "FeedForward", "FixedTable", "KVCache",
    "LayerNorm", "Learned", "Linear", "MultiHeadAttention", "NoPosition", "PagedKVCache", "PatchGrid",
    "PositionalEncoding", "RMSNorm", "RoPE", "Sinusoidal", "Stack", "StackOutput", "StaticCache",
    "build_norm", "build_position", "causal_mask", "check_length", "check_token_ids", "count_parameters",
    "scaled_dot_product_attention", "step_scores_bias", "tied_names",
]
