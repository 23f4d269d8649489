"""A BERT folder with only vocab.txt (no tokenizer.json): read as transformers' BertTokenizer reads it,
lower-cased unless the folder's tokenizer_config.json says do_lower_case: false (a cased BERT)."""

from __future__ import annotations

import json

import pytest

from qkv.tasks.tokenizers import find_tokenizer

transformers = pytest.importorskip("transformers")
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "Hello", "hello", "World", "world", "helo", "##s",
         "cafe", "café", "Café"]
TEXTS = ["Hello World", "hello worlds", "HELLO world", "Café café cafe", "Hello, unknown!"]


@pytest.mark.parametrize("config", [None, {"do_lower_case": True}, {"do_lower_case": False},
                                    {"do_lower_case": True, "strip_accents": False}])
def test_a_vocab_txt_folder_encodes_as_bert_tokenizer(tmp_path, config):
    (tmp_path / "vocab.txt").write_text("\n".join(WORDS) + "\n", encoding="utf-8")
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = find_tokenizer(tmp_path)
    ref = transformers.BertTokenizer(str(tmp_path / "vocab.txt"), **(config or {}))
    for text in TEXTS:
        assert ours.encode(text) == ref(text).input_ids, text
