"""Fixtures for the server tests: tiny folders built here, never downloaded (the server: _servehelpers.py)."""

from __future__ import annotations

import json

import pytest
import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="session")
def run_folder(tmp_path_factory):
    """A qkv run folder: a tiny character LM (task.json + tokenizer + random model), no training."""
    from qkv.tasks import build_task

    path = tmp_path_factory.mktemp("run")
    task = build_task("charlm", family="gpt", context=64)
    model = task.build_model("gpt-nano", d_model=32, n_heads=2, n_layers=2, position="learned", init_std=0.3)
    task.save(path)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def gpt2_folder(tmp_path_factory):
    """A Hugging Face GPT-2 folder: a byte-level BPE tokenizer trained on stdlib text, a chat template,
    random transformers weights, all saved here."""
    import pydoc_data.topics

    import transformers
    from tokenizers import ByteLevelBPETokenizer

    path = tmp_path_factory.mktemp("gpt2")
    texts = list(pydoc_data.topics.topics.values())[:40]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        texts,
        vocab_size=400,
        min_frequency=2,
        special_tokens=["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"],
    )
    bpe.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|end|>", "chat_template": CHAT_TEMPLATE})
    )
    V = bpe.get_vocab_size()
    # the same weights whichever tests ran first in this process (checks below depend on them)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=96, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=4, initializer_range=0.3)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(path)
    return path
