"""--speculative on qkv generate / qkv chat: prompt lookup and a draft folder give the text of plain greedy
decoding; a draft with another vocabulary, or one where no draft can run, is a one-line error (exit 2)."""

from __future__ import annotations

import pydoc_data.topics

import pytest
import torch

from qkv.cli.main import main

transformers = pytest.importorskip("transformers")


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(pydoc_data.topics.topics.values())[:20], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _llama(path, tok, seed: int, layers: int):
    tok.save_pretrained(path)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, initializer_range=0.2,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tok = _tokenizer(320)
    root = tmp_path_factory.mktemp("spec")
    return (_llama(root / "target", tok, 0, 2), _llama(root / "draft", tok, 1, 1),
            _llama(root / "other", _tokenizer(300), 1, 1))


PROMPT = "The with statement. The with statement"


def _run(argv, capsys) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_generate_text_is_plain_greedy(folders, capsys):
    target, draft, _ = folders
    base = ["generate", str(target), "--prompt", PROMPT, "--greedy", "--max-new-tokens", "16"]
    want = _run(base, capsys)
    assert len(want.strip()) > len(PROMPT)
    assert _run([*base, "--speculative", "prompt-lookup"], capsys) == want
    assert _run([*base, "--speculative", str(draft)], capsys) == want
    assert _run([*base, "--speculative", str(draft), "--stream"], capsys).rstrip("\n") == want.rstrip("\n")


def test_chat_answer_is_plain_greedy(folders, capsys):
    target, draft, _ = folders
    base = ["chat", str(target), "--message", PROMPT, "--greedy", "--max-new-tokens", "12"]
    want = _run(base, capsys)
    assert want.strip()
    assert _run([*base, "--speculative", "prompt-lookup"], capsys) == want
    assert _run([*base, "--speculative", str(draft)], capsys) == want


def test_a_draft_of_another_vocabulary_is_refused(folders, capsys):
    target, _, other = folders
    for command in ("generate", "chat"):
        flag = "--prompt" if command == "generate" else "--message"
        assert main([command, str(target), flag, "hi", "--greedy", "--speculative", str(other)]) == 2
        assert "same tokenizer" in capsys.readouterr().err
