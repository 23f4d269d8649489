"""Tiny Hugging Face folders built here with random weights (nothing downloaded): a GPT-2 with a byte-level
BPE trained on pydoc's topics text and a ChatML chat template in tokenizer_config.json."""

from __future__ import annotations

import json
import pydoc_data.topics
from pathlib import Path

import pytest

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML (Qwen2 / SmolLM style): the end-of-turn token <|im_end|> is the tokenizer's eos
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# the same template with the assistant's part marked for transformers' return_assistant_tokens_mask: the
# independent reference of which tokens carry the loss
CHATML_GENERATION = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
                     "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
                     "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}"
                     "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_tokenizer(folder: Path, chat_template: str | None = CHATML, vocab: int = 400) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = list(pydoc_data.topics.topics.values())
    tok.train_from_iterator(text, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    _write_tokenizer_config(folder, chat_template)
    return {s: tok.token_to_id(s) for s in SPECIALS}


def _write_tokenizer_config(folder: Path, chat_template: str | None) -> None:
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
           "pad_token": "<|endoftext|>", "model_max_length": 128}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")


def write_gpt2(folder: Path, chat_template: str | None = CHATML, n_positions: int = 96, init_std: float = 0.02,
               tokenizer_from: Path | None = None) -> Path:
    """A random GPT2LMHeadModel folder; tokenizer_from: copy that folder's tokenizer.json (training one takes
    seconds) and write this folder's own tokenizer_config.json."""
    import shutil

    import torch
    import transformers

    if tokenizer_from is not None:
        from tokenizers import Tokenizer

        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tokenizer_from / "tokenizer.json", folder / "tokenizer.json")
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        ids = {s: tok.token_to_id(s) for s in SPECIALS}
        _write_tokenizer_config(folder, chat_template)
    else:
        ids = write_tokenizer(folder, chat_template)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=400, n_positions=n_positions, n_embd=64, n_layer=2, n_head=4,
                                  bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                                  pad_token_id=ids["<|endoftext|>"], initializer_range=init_std)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    return folder


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
    return write_gpt2(tmp_path_factory.mktemp("gpt2_plain") / "model", chat_template=None, tokenizer_from=gpt2_chat)


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
