"""Building blocks: they know no model family, no training and no task."""

from qkv.nn.attention import MultiHeadAttention, causal_mask, scaled_dot_product_attention
from qkv.nn.block import Block
from qkv.nn.cache import KVCache, StaticCache
from qkv.nn.ffn import FeedForward
from qkv.nn.norm import BatchNorm, LayerNorm, RMSNorm, build_norm
from qkv.nn.position import ALiBi, Learned, NoPosition, PositionalEncoding, RoPE, Sinusoidal, build_position
from qkv.nn.stack import Stack, StackOutput

__all__ = [
    "ALiBi", "BatchNorm", "Block", "FeedForward", "KVCache", "LayerNorm", "Learned", "MultiHeadAttention",
    "NoPosition", "PositionalEncoding", "RMSNorm", "RoPE", "Sinusoidal", "Stack", "StackOutput", "StaticCache",
    "build_norm", "build_position", "causal_mask", "scaled_dot_product_attention",
]
