"""The issue's 135M-class Llama (random weights, transformers' init, seed 0) saved once as a bf16 folder; the scripts
beside this file take its path (default /tmp/qkv_llama135m_bf16, built on first use)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=10000.0)


def folder() -> str:
    path = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "/tmp/qkv_llama135m_bf16"
    if not os.path.exists(os.path.join(path, "config.json")):
        import torch
        import transformers

        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).to(torch.bfloat16).save_pretrained(path)
    return path
