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


IMG = 50  # tiny_llava's placeholder id (inside its 60-token vocabulary)


def tiny_llava(init_std: float = 0.3):
    """A LLaVA with a 1-block CLIP-style tower on 16 px images of 8 px patches (4 image tokens each) and a
    2-block Llama-style decoder; the large init makes greedy answers depend on the image."""
    import torch

    from qkv.models.gpt import GPTConfig
    from qkv.models.vlm import LLaVA, VisionConfig, VLMConfig

    vision = VisionConfig(image_size=16, patch_size=8, n_layers=1, d_model=32, n_heads=4, d_ff=64,
                          init_std=init_std)
    text = GPTConfig(vocab_size=60, n_layers=2, d_model=48, n_heads=4, n_kv_heads=2, d_ff=96, ffn="swiglu",
                     norm="rmsnorm", position="rope", bias=False, context_length=64, tie_embeddings=False,
                     init_std=init_std)
    torch.manual_seed(0)
    return LLaVA(VLMConfig(vision=vision, text=text, image_token_id=IMG)).eval()
