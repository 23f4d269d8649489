"""A T5 folder with only spiece.model (the google/t5-v1_1-* layout, no tokenizer.json): qkv's tokenizer knows
T5's sentinels <extra_id_N> as transformers.T5Tokenizer does (ids after the pieces, counted down from the
last; decoded back, or skipped as special tokens). A non-T5 spiece.model folder gains no sentinels."""

from __future__ import annotations

import io
import json
import random

import pytest

from qkv.tasks.tokenizers import find_tokenizer

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TEXTS = ["the cat <extra_id_0> fast", "the cat<extra_id_0>fast.", "<extra_id_0> the <extra_id_1>",
         "<extra_id_9>",
         "a  <extra_id_3>  big, green tree <extra_id_1><extra_id_2> runs", "x<extra_id_2><extra_id_1>y",
         " the dog  ", "", "the </s> cat <pad> is <unk> slow", "<extra_id_10> and <extra_id_99> are not all",
         "small house, big dog."]


def _spiece(folder, model_type: str = "t5", **tokenizer_config) -> None:
    """A tiny SentencePiece model trained here (pad 0, eos 1, unk 2: T5's layout) and a config.json."""
    rnd = random.Random(0)
    words = "house small the is a big cat dog runs fast slow tree green , .".split()
    lines = [" ".join(rnd.choice(words) for _ in range(8)) for _ in range(500)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=30, pad_id=0,
                                   eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
    (folder / "spiece.model").write_bytes(buf.getvalue())
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    if tokenizer_config:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


@pytest.mark.parametrize("config", [{}, {"extra_ids": 10},
                                    {"extra_ids": 3,
                                     "additional_special_tokens": [f"<extra_id_{i}>" for i in range(3)]},
                                    {"extra_ids": 0,
                                     "additional_special_tokens": ["<extra_id_1>", "<extra_id_0>"]},
                                    {"extra_ids": 2,
                                     "additional_special_tokens": ["<extra_id_1>", "<x>", "<extra_id_0>"]}])
def test_t5_sentinels_encode_and_decode_as_t5tokenizer(tmp_path, config):
    _spiece(tmp_path, **config)
    ref = transformers.T5Tokenizer.from_pretrained(tmp_path)
    tok = find_tokenizer(tmp_path)
    assert tok.get_vocab_size() == len(ref)
    for text in TEXTS:
        ids = ref(text).input_ids
        assert tok.encode(text) == ids, text
        for skip in (True, False):
            assert (tok.decode(ids, skip_special_tokens=skip)
                    == ref.decode(ids, skip_special_tokens=skip)), (text, skip)
        # the default skips, as qkv generate
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    if "additional_special_tokens" not in config:
        n = config.get("extra_ids", 100)
        assert tok.encode("<extra_id_0>")[0] == 30 + n - 1 and tok.encode(f"<extra_id_{n - 1}>")[0] == 30


def test_a_non_t5_spiece_folder_gains_no_sentinels(tmp_path):
    _spiece(tmp_path, model_type="albert")
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "spiece.model"))
    tok = find_tokenizer(tmp_path)
    text = "the cat <extra_id_0> fast"
    assert tok.encode(text) == sp.encode(text) + [1]
    assert tok.get_vocab_size() == sp.get_piece_size()
