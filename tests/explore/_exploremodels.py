"""Shapes of the tiny Hugging Face GPT-2 folder the explorer tests build (conftest.hf_gpt2)."""

N_LAYER, N_HEAD, N_EMBD, N_POSITIONS = 2, 4, 32, 40
