"""Tiny Hugging Face folders built here with random weights (nothing downloaded): a GPT-2 with a byte-level
BPE trained on pydoc's topics text and a ChatML chat template in tokenizer_config.json."""

from __future__ import annotations

from pathlib import Path

import pytest
from _chatfolders import (  # noqa: F401
    CHATML,
    CHATML_GENERATION,
    _write_tokenizer_config,
    write_gpt2,
    write_tokenizer,
)


@pytest.fixture(scope="session")
def gpt2_chat(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    return write_gpt2(tmp_path_factory.mktemp("gpt2_chat") / "model")


@pytest.fixture(scope="session")
def gpt2_chat_lora(tmp_path_factory, gpt2_chat) -> Path:
    """For LoRA: init std 0.1, not GPT-2's 0.02. With a frozen random embedding of std 0.02 (tied to the head)
    no logit can rise much above the others (|h| * |e| ~ 8 * 0.16 after the final norm), so no adapter on the
    blocks could lower the loss below ~4.7 nats; a real pretrained model has no such floor."""
    return write_gpt2(tmp_path_factory.mktemp("gpt2_lora") / "model", init_std=0.1, tokenizer_from=gpt2_chat)


@pytest.fixture(scope="session")
def gpt2_plain(tmp_path_factory, gpt2_chat) -> Path:
    """The same model without a chat template."""
    pytest.importorskip("transformers")
    return write_gpt2(tmp_path_factory.mktemp("gpt2_plain") / "model", chat_template=None,
                      tokenizer_from=gpt2_chat)


@pytest.fixture(scope="session")
def chatml_generation() -> str:
    return CHATML_GENERATION


@pytest.fixture(scope="session")
def llama_chat(tmp_path_factory, gpt2_chat) -> Path:
    """A tiny random LlamaForCausalLM folder (GQA 2:1, untied head) with the same tokenizer and template."""
    pytest.importorskip("transformers")
    import shutil

    import torch
    import transformers
    from tokenizers import Tokenizer

    folder = tmp_path_factory.mktemp("llama_chat") / "model"
    folder.mkdir(parents=True)
    shutil.copyfile(gpt2_chat / "tokenizer.json", folder / "tokenizer.json")
    _write_tokenizer_config(folder, CHATML)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                                   tie_word_embeddings=False, bos_token_id=tok.token_to_id("<|endoftext|>"),
                                   eos_token_id=tok.token_to_id("<|im_end|>"),
                                   pad_token_id=tok.token_to_id("<|endoftext|>"))
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder
