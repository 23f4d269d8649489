"""Tiny Hugging Face chat folders for the fine-tuning tests (random weights, nothing downloaded): the ChatML
templates and the folder writers. A module with its own name: `from conftest import` would be ambiguous beside
other test folders' conftest under pytest-xdist."""

from __future__ import annotations

import json
import pydoc_data.topics
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML (Qwen2 / SmolLM style): the end-of-turn token <|im_end|> is the tokenizer's eos
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' "
          "}}{% endif %}")
# the same template with the assistant's part marked for transformers' return_assistant_tokens_mask: the
# independent reference of which tokens carry the loss
CHATML_GENERATION = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
                     "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + "
                     "'<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% "
                     "endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ "
                     "'<|im_start|>assistant\\n' }}{% endif %}")


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
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
           "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 128}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")


def write_gpt2(folder: Path, chat_template: str | None = CHATML, n_positions: int = 96,
               init_std: float = 0.02, tokenizer_from: Path | None = None) -> Path:
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
