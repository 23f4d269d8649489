"""Tiny decoders for the generation tests (random weights with a large init, so logits are far from uniform
and greedy decoding does not just repeat one token)."""

from __future__ import annotations

import qkv

POSITIONS = ("none", "sinusoidal", "learned", "rope", "alibi")
BACKENDS = ("naive", "fused")


def tiny_gpt(position: str = "learned", backend: str = "fused", gqa: bool = False, *, vocab: int = 11,
             context: int = 32, init_std: float = 0.3, **kw):
    return qkv.build("gpt-nano", vocab_size=vocab, n_layers=2, d_model=32, n_heads=4,
                     n_kv_heads=2 if gqa else None, context_length=context, position=position,
                     attention=backend, init_std=init_std, **kw).eval()


def tiny_encdec(position: str = "sinusoidal", backend: str = "fused", gqa: bool = False, *, vocab: int = 11,
                context: int = 32, init_std: float = 0.3, **kw):
    return qkv.build("transformer-tiny", src_vocab_size=vocab, n_encoder_layers=2, n_decoder_layers=2,
                     d_model=32, n_heads=4, d_ff=64, n_kv_heads=2 if gqa else None, context_length=context,
                     position=position, attention=backend, init_std=init_std, **kw).eval()
