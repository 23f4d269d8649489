"""`qkv generate --json-schema FILE`: a random-weight Hugging Face folder's output is JSON valid against the
schema (only the grammar's mask can make it so), streamed or not; a file that is no schema is one line."""

from __future__ import annotations

import json
import pydoc_data.topics

import jsonschema
import pytest
import torch

from qkv.cli.main import main

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "label": {"enum": ["spam", "ham"]},
                                           "words": {"type": "array", "items": {"type": "string",
                                                                                "maxLength": 4},
                                                     "maxItems": 2}},
          "required": ["id", "label", "words"], "additionalProperties": False}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from tokenizers import ByteLevelBPETokenizer

    path = tmp_path_factory.mktemp("gpt2json")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(list(pydoc_data.topics.topics.values())[:30], vocab_size=350, min_frequency=2,
                            special_tokens=["<|endoftext|>"])
    bpe.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=350, n_positions=256, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0, initializer_range=0.5)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(path)
    (path / "schema.json").write_text(json.dumps(SCHEMA))
    return path


@pytest.mark.parametrize("extra", [["--greedy"], ["--seed", "4"], ["--seed", "5", "--stream"]])
def test_output_validates_against_the_schema(folder, extra, capsys):
    assert main(["generate", str(folder), "--prompt", "Label:", "--max-new-tokens", "120",
                 "--json-schema", str(folder / "schema.json"), *extra]) == 0
    out = capsys.readouterr().out.rstrip("\n")
    assert out.startswith("Label:")
    jsonschema.validate(json.loads(out[len("Label:"):]), SCHEMA)


def test_a_file_that_is_no_schema_is_one_line(folder, tmp_path, capsys):
    (tmp_path / "bad.json").write_text('{"type": "object", "properties": {"a": {"type": "nope"}}}')
    (tmp_path / "list.json").write_text("[1, 2]")
    for bad, said in ((tmp_path / "bad.json", "nope"), (tmp_path / "list.json", "JSON object"),
                      (tmp_path / "missing.json", "cannot read")):
        assert main(["generate", str(folder), "--prompt", "x", "--json-schema", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("qkv: error:") and said in err and len(err.strip().splitlines()) == 1, err
