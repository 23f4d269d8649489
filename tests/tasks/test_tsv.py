"""Translation on a user TSV file: parsing, errors, split, tokenizers, batches."""

from __future__ import annotations

import pytest
import torch

from qkv.config import ConfigError
from qkv.tasks import build_task, load_task
from qkv.tasks.tokenizers import SEP

PAIRS = [(f"the {c} cat number {i}", f"le chat {c} numéro {i}") for i, c in enumerate(
    ["black", "white", "grey", "ginger", "small", "big", "old", "young"] * 5)]


@pytest.fixture()
def tsv(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("\n".join(f"{s}\t{t}" for s, t in PAIRS[:20]) + "\n\n" + "\n".join(
        f"{s}\t{t}" for s, t in PAIRS[20:]) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
@pytest.mark.parametrize("family", ["encdec", "gpt"])
def test_split_and_batches(tsv, tokenizer, family):
    task = build_task("tsv", family=family, path=str(tsv), tokenizer=tokenizer, bpe_vocab_size=300,
                      val_fraction=0.25)
    train, val = task.split_pairs["train"], task.split_pairs["val"]
    assert len(val) == 10 and len(train) == 30
    assert sorted(train + val) == sorted(PAIRS)  # a partition of the file's pairs
    assert not set(train) & set(val)  # the example pairs are all distinct, so no overlap either
    again = build_task("tsv", family=family, path=str(tsv), tokenizer=tokenizer, bpe_vocab_size=300,
                       val_fraction=0.25)
    assert again.split_pairs == task.split_pairs  # seeded
    assert build_task("tsv", path=str(tsv), seed=1, val_fraction=0.25).split_pairs["val"] != val
    tok = task.tokenizer
    pairs = task.pairs(4, 8, "train")
    assert all(p in train for p in pairs)
    b = task.batch(4, 8)
    for i, (s, t) in enumerate(pairs):
        row = b["input_ids"][i][b["attention_mask"][i].bool()].tolist()
        if family == "encdec":
            assert tok.decode(row) == s
            assert tok.decode([x for x in b["labels"][i].tolist() if x != -100]) == t
        else:
            cut = row.index(SEP)
            assert tok.decode(row[:cut]) == s and tok.decode(row[cut + 1:]) == t
    assert b["input_ids"].shape[1] <= task.context_length
    assert task.eval_pairs(3) == val[:3]


def test_bleu_tokenize_and_rebuild(tsv, tmp_path):
    task = build_task("tsv", path=str(tsv), bleu_tokenize="char", tokenizer="bpe", bpe_vocab_size=300)
    assert task.bleu_tokenize == "char"
    task.save(tmp_path / "run")
    again = load_task(tmp_path / "run")
    assert torch.equal(again.batch(2, 4)["labels"], task.batch(2, 4)["labels"])
    tsv.unlink()  # the data is gone: the saved tokenizer still translates, batches say what is missing
    gone = load_task(tmp_path / "run")
    assert gone.tokenizer.vocab_size == task.tokenizer.vocab_size
    with pytest.raises(ConfigError, match="not found"):
        gone.batch(0, 2)
    with pytest.raises(ConfigError, match="not found"):
        build_task("tsv", path=str(tsv))
    tsv.write_text("a\tb\nc\td\n")
    with pytest.raises(ConfigError, match="bleu_tokenize"):
        build_task("tsv", path=str(tsv), bleu_tokenize="klingon")


def test_max_len_drops_long_pairs(tsv):
    task = build_task("tsv", path=str(tsv), max_len=22)
    kept = task.split_pairs["train"] + task.split_pairs["val"]
    assert all(len(s) <= 22 and len(t) <= 22 for s, t in kept)
    assert task.n_dropped == len(PAIRS) - len(kept) > 0


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        build_task("tsv", path=str(tmp_path / "nope.tsv"))
    with pytest.raises(ConfigError, match="task.path is required"):
        build_task("tsv")
    empty = tmp_path / "empty.tsv"
    empty.write_text("\n\n")
    with pytest.raises(ConfigError, match="TSV file is empty"):
        build_task("tsv", path=str(empty))
    bad = tmp_path / "bad.tsv"
    bad.write_text("a\tb\nno tab here\n")
    with pytest.raises(ConfigError, match=r"bad.tsv:2: expected 'source<TAB>target'"):
        build_task("tsv", path=str(bad))
    one = tmp_path / "one.tsv"
    one.write_text("a\tb\n")
    with pytest.raises(ConfigError, match="too few"):
        build_task("tsv", path=str(one))
    binary = tmp_path / "bin.tsv"
    binary.write_bytes(b"\xff\xfe\x00a\tb")
    with pytest.raises(ConfigError, match="not UTF-8"):
        build_task("tsv", path=str(binary))
