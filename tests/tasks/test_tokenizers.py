"""Tokenizers: round trips, unknown characters, out-of-range ids, special tokens, save/load."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.tasks.tokenizers import (
    SPECIALS,
    BPETokenizer,
    CharTokenizer,
    TokenizerError,
    WordTokenizer,
    load_tokenizer,
    save_tokenizer,
)


def test_special_ids_are_fixed_and_first():
    tok = CharTokenizer("abc")
    assert tok.itos[: len(SPECIALS)] == list(SPECIALS)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.sep_id, tok.unk_id, tok.mask_id) == (0, 1, 2, 3, 4, 5)
    assert [SPECIALS[i] for i in (tok.pad_id, tok.eos_id)] == ["<pad>", "<eos>"]
    assert tok.vocab_size == len(SPECIALS) + 3


def test_char_round_trip_and_vocabulary_from_text():
    text = "hello, wörld 你好\n"
    tok = CharTokenizer.from_text(text)
    assert tok.vocab_size == len(SPECIALS) + len(set(text))
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert all(i >= len(SPECIALS) for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text  # tensors too


def test_unknown_character_maps_to_unk_or_raises_when_strict():
    tok = CharTokenizer("ab")
    assert tok.encode("abz") == [tok.stoi["a"], tok.stoi["b"], tok.unk_id]
    with pytest.raises(TokenizerError, match="'z'"):
        CharTokenizer("ab", strict=True).encode("abz")


def test_decode_skips_specials_unless_asked():
    tok = CharTokenizer("ab")
    ids = [tok.bos_id, tok.stoi["a"], tok.sep_id, tok.stoi["b"], tok.eos_id, tok.pad_id]
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special=False) == "<bos>a<sep>b<eos><pad>"


@pytest.mark.parametrize("bad", [-1, 8, 1000])
def test_decode_out_of_range_is_a_clear_error(bad):
    tok = CharTokenizer("ab")  # vocab 8
    with pytest.raises(TokenizerError, match=f"token id {bad} is outside the vocabulary"):
        tok.decode([6, bad])
    assert issubclass(TokenizerError, ValueError)


def test_special_name_cannot_be_a_symbol():
    with pytest.raises(TokenizerError):
        WordTokenizer(["x", "<pad>"])


def test_word_tokenizer():
    tok = WordTokenizer.from_text("[MAX 2 9 ] [MIN 3 ]")
    ids = tok.encode("[MAX 2  9 ]")
    assert len(ids) == 4
    assert tok.decode(ids) == "[MAX 2 9 ]"
    assert tok.encode("[FOO 2")[0] == tok.unk_id


@pytest.mark.parametrize("make", [
    lambda: CharTokenizer.from_text("the quick brown fox 你好"),
    lambda: WordTokenizer(["[MAX", "]", "1", "2"]),
    lambda: BPETokenizer.train(["the quick brown fox jumps over the lazy dog " * 20, "你好世界"],
                               vocab_size=300),
])
def test_save_load_round_trip(tmp_path, make):
    tok = make()
    save_tokenizer(tok, tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    kind = json.loads((tmp_path / "tokenizer_config.json").read_text())["kind"]
    assert kind == tok.kind
    back = load_tokenizer(tmp_path)
    assert type(back) is type(tok) and back.vocab_size == tok.vocab_size
    text = "the fox 你好" if tok.kind != "word" else "[MAX 1 2 ]"
    assert back.encode(text) == tok.encode(text)
    assert back.decode(tok.encode(text)) == text
    # the kind file is optional: detection from tokenizer.json alone
    (tmp_path / "tokenizer_config.json").unlink()
    assert type(load_tokenizer(tmp_path / "tokenizer.json")) is type(tok)


def test_bpe_specials_merges_and_any_text():
    text = "def function(argument):\n    return argument\n" * 50
    tok = BPETokenizer.train(text, vocab_size=300)
    assert tok.vocab_size <= 300
    for i, s in enumerate(SPECIALS):
        assert tok.hf.token_to_id(s) == i
    ids = tok.encode(text)
    assert len(ids) < len(text) / 2  # merges learned: far fewer tokens than bytes
    assert tok.decode(ids) == text
    odd = "ünïcödé ∑ 🙂 never seen"  # byte-level: nothing is unknown
    assert tok.decode(tok.encode(odd)) == odd
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(TokenizerError, match="vocab_size"):
        BPETokenizer.train(text, vocab_size=100)


def test_load_errors(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"qkv_tokenizer": "klingon"}')
    with pytest.raises(TokenizerError, match="unknown tokenizer kind"):
        load_tokenizer(tmp_path)
