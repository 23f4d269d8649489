"""Every tokenizer kind qkv has is a qkv.tokenizer.TextTokenizer (encode -> list[int], decode -> str,
bos/eos/pad ids, vocab_size, chat_template) and round-trips a sample text through encode/decode."""

from __future__ import annotations

import io
import json
import random
import sys
from pathlib import Path

import pytest

from qkv.interop.tokenizer import HFTokenizer, load_hf_tokenizer
from qkv.tasks.tokenizers import BPETokenizer, CharTokenizer, WordTokenizer, find_tokenizer
from qkv.tokenizer import TextTokenizer

TEXT = "the cat runs fast"
WORDS = "the cat dog runs fast slow big small tree green".split()
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _corpus(n: int = 300) -> list[str]:
    rnd = random.Random(0)
    return [" ".join(rnd.choice(WORDS) for _ in range(8)) for _ in range(n)]


def check(tok, text: str = TEXT) -> list[int]:
    """The protocol holds and `text` comes back from its ids (less the bos/eos/pad the tokenizer adds)."""
    assert isinstance(tok, TextTokenizer), type(tok)
    ids = tok.encode(text)
    assert isinstance(ids, list) and ids and all(type(i) is int and 0 <= i < tok.vocab_size for i in ids)
    for name in ("bos_id", "eos_id", "pad_id"):
        value = getattr(tok, name)
        assert value is None or (type(value) is int and 0 <= value < tok.vocab_size), (name, value)
    added = {tok.bos_id, tok.eos_id, tok.pad_id} - {None}
    assert tok.decode([i for i in ids if i not in added]) == text
    assert tok.chat_template is None or isinstance(tok.chat_template, str)
    return ids


def _hf_bpe_folder(folder: Path) -> Path:
    """A tiny byte-level BPE tokenizer.json trained here, with ChatML specials and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<pad>",
              "chat_template": CHATML}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_qkv_task_tokenizers():
    for tok in (CharTokenizer.from_text(TEXT), WordTokenizer.from_text(TEXT),
                BPETokenizer.train(_corpus(), vocab_size=300)):
        check(tok)
        assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 0) and tok.chat_template is None


def test_a_hugging_face_folder_with_its_chat_template(tmp_path):
    tok = load_hf_tokenizer(_hf_bpe_folder(tmp_path))
    check(tok)
    assert tok.bos_id == tok.token_to_id("<|endoftext|>") and tok.eos_id == tok.token_to_id("<|im_end|>")
    assert tok.pad_id == tok.token_to_id("<pad>")
    assert tok.chat_template == CHATML
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # transformers' default: special tokens are kept by the folder's own tokenizer
    assert tok.decode([tok.eos_id]) == "<|im_end|>"


def test_find_tokenizer_gives_the_bare_folder_tokenizer(tmp_path):
    tok = find_tokenizer(_hf_bpe_folder(tmp_path))
    assert isinstance(tok, HFTokenizer)
    ids = check(tok)
    assert ids == tok.tokenizer.encode(TEXT).ids  # what the `tokenizers` object gives, nothing added
    assert tok.decode([*ids, tok.eos_id]) == TEXT  # and it drops special tokens, as that object's decode
    assert tok.eos_id == tok.token_to_id("<|im_end|>")


def test_a_bare_tokenizers_object_is_not_one():
    """Its encode returns an Encoding, not ids: qkv wraps it (interop.tokenizer.bare_tokenizer)."""
    from tokenizers import Tokenizer, models

    assert not isinstance(Tokenizer(models.BPE()), TextTokenizer)


def test_a_bert_vocab_txt_folder(tmp_path):
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (tmp_path / "vocab.txt").write_text("\n".join([*specials, *WORDS]) + "\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "[PAD]"}))
    tok = find_tokenizer(tmp_path)
    ids = check(tok)
    assert ids[0] == 2 and ids[-1] == 3  # [CLS] ... [SEP]
    assert tok.pad_id == 0 and tok.bos_id is None


def _gguf_file(path: Path, vocab: dict) -> Path:
    """A GGUF file holding only a tokenizer (the metadata load_gguf_tokenizer reads)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(vocab["model"])
    w.add_tokenizer_pre("llama-bpe" if vocab["model"] == "gpt2" else "default")
    w.add_token_list(vocab["tokens"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    w.add_token_types(vocab["types"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    w.add_add_bos_token(vocab["add_bos"])
    w.add_chat_template(vocab["template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind", ["bpe", "spm"])
def test_a_gguf_files_tokenizer(tmp_path, kind):
    pytest.importorskip("gguf")
    pytest.importorskip("sentencepiece")
    from qkv.interop.gguf_tokenizer import load_gguf_tokenizer

    sys.path.insert(0, str(Path(__file__).parent / "interop"))  # the GGUF tests' tokenizer builders
    from _gguf_files import bpe_vocab, spm_vocab

    vocab = bpe_vocab() if kind == "bpe" else spm_vocab(tmp_path)
    path = _gguf_file(tmp_path / f"{kind}.gguf", vocab)
    text = "Hello world, this is a tiny corpus"
    tok = load_gguf_tokenizer(path)
    ids = check(tok, text)
    assert (tok.bos_id, tok.eos_id) == (vocab["bos"], vocab["eos"]) and tok.chat_template == vocab["template"]
    assert (ids[0] == vocab["bos"]) == vocab["add_bos"]
    bare = find_tokenizer(path)
    assert check(bare, text) == ids and bare.decode(ids) == text


def _sentencepiece(**options) -> bytes:
    spm = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_corpus()), model_writer=buf, vocab_size=30,
                                   minloglevel=2, **options)
    return buf.getvalue()


@pytest.mark.parametrize("model_type", ["t5", "albert"])
def test_a_spiece_model_folder(tmp_path, model_type):
    from qkv.tasks.spm import SPTokenizer, T5SPTokenizer

    (tmp_path / "spiece.model").write_bytes(_sentencepiece(pad_id=0, eos_id=1, unk_id=2, bos_id=-1))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    tok = find_tokenizer(tmp_path)
    assert type(tok) is (T5SPTokenizer if model_type == "t5" else SPTokenizer)
    ids = check(tok)
    assert ids[-1] == tok.eos_id == 1 and tok.pad_id == 0 and tok.bos_id is None
    assert tok.vocab_size == tok.get_vocab_size() == 30 + (100 if model_type == "t5" else 0)


def test_a_marian_folder(tmp_path):
    import sentencepiece as spm

    from qkv.tasks.spm import MarianSPTokenizer

    model = _sentencepiece(model_type="unigram")
    for name in ("source.spm", "target.spm"):
        (tmp_path / name).write_bytes(model)
    sp = spm.SentencePieceProcessor(model_proto=model)
    pieces = [sp.id_to_piece(i) for i in range(3, sp.get_piece_size())]
    vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(pieces)}}
    vocab["<pad>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    tok = find_tokenizer(tmp_path)
    assert isinstance(tok, MarianSPTokenizer)
    ids = check(tok)
    assert ids[-1] == tok.eos_id == 0 and tok.pad_id == len(vocab) - 1 and tok.vocab_size == len(vocab)
