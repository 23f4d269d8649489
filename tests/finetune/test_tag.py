"""`qkv finetune --task tag`: CoNLL NER on a tiny random BERT reaches a high entity F1, the folder gives the
same logits in transformers (AutoModelForTokenClassification); the entity F1 equals seqeval's on random tag
sequences; bad CoNLL is one clear line and exit 2."""

from __future__ import annotations

import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _encoders import conll_sentences, make_folder, write_conll  # noqa: E402

import qkv  # noqa: E402
from qkv.cli.main import main  # noqa: E402
from qkv.finetune.tag import entities, entity_scores, read_conll_lines  # noqa: E402


def test_tag_learns_and_round_trips(tmp_path, capsys):
    folder = make_folder(tmp_path / "bert", "bert")
    train = write_conll(tmp_path / "train.conll", conll_sentences(200, 1))
    dev = write_conll(tmp_path / "dev.conll", conll_sentences(60, 2))
    out = tmp_path / "out"
    assert main(["finetune", str(folder), "--task", "tag", "--data", str(train), "--dev", str(dev), "--out",
                 str(out), "--epochs", "6", "--no-progress", "train.lr=2e-3", "train.warmup=0.1",
                 "train.tensorboard=false"]) == 0
    report = capsys.readouterr().out
    result = json.loads((out / "finetune.json").read_text())
    assert result["dev"]["f1"] >= 0.9, report
    assert result["tags"][0] == "O" and len(result["tags"]) == 7
    hf = transformers.AutoModelForTokenClassification.from_pretrained(out).eval()
    assert type(hf).__name__ == "BertForTokenClassification" and hf.config.id2label[0] == "O"
    ours = qkv.from_pretrained(out)
    assert ours.config.head == "tag"
    ids = torch.randint(5, 50, (4, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=1e-4, rtol=1e-4)


def test_entity_f1_equals_seqeval():
    seqeval = pytest.importorskip("seqeval.metrics")
    rng = random.Random(0)
    tags = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    for _ in range(200):
        gold = [[rng.choice(tags) for _ in range(rng.randint(1, 9))] for _ in range(4)]
        pred = [[t if rng.random() < 0.6 else rng.choice(tags) for t in s] for s in gold]
        ours = entity_scores(gold, pred)
        assert ours["f1"] == pytest.approx(seqeval.f1_score(gold, pred, zero_division=0))
        assert ours["precision"] == pytest.approx(seqeval.precision_score(gold, pred, zero_division=0))
        assert ours["recall"] == pytest.approx(seqeval.recall_score(gold, pred, zero_division=0))


def test_entities_of_known_sequences():
    # I- after O starts an entity (conlleval), a type change splits one, B- always starts a new one
    assert entities(["B-PER", "I-PER", "O", "I-LOC", "I-LOC", "B-LOC", "I-PER"]) == {
        ("PER", 0, 1), ("LOC", 3, 4), ("LOC", 5, 5), ("PER", 6, 6)}


@pytest.mark.parametrize("text, dev, message", [
    ("w1 O\nalice\n", None, "line 2: expected a token and its tag"),
    ("w1 O\nalice PERSON\n", None, "'PERSON' is not a BIO/IOBES tag"),
    ("\n\n", None, "no sentences"),
    ("w1 O\nalice B-PER\n", "rome B-LOC\n", "tag 'B-LOC' (in 'rome') does not occur in the training data"),
    # uneven columns (a token with a space in it, a missing POS column) used to be read silently, a wrong
    # column then taken for the tag when --tag-column is not the last
    ("w1 NN O\nalice NNP B-PER\n\nw2 O\n", None, "t.conll line 4: 2 columns, line 1 has 3 (every token line"),
    ("w1 NN O\nnew york NNP B-LOC\n", None, "t.conll line 2: 4 columns, line 1 has 3"),
    # the dev file's unknown tag: its line (the sentence's first line + the token's place in it)
    ("w1 O\nalice B-PER\n", "w1 O\n\nw2 O\nrome B-LOC\n", "d.conll line 4: tag 'B-LOC' (in 'w2 rome')"),
    # a sentence over the context (64) names the file and its first line, not "example 2"
    ("w1 O\n\n" + "w2 O\n" * 70 + "\nw3 O\n", None,
     "t.conll line 3: 1 example(s) longer than the model's context of 64 tokens (this is the first, 72 "
     "tokens)"),
])
def test_bad_conll_is_one_line_and_exit_2(tmp_path, capsys, text, dev, message):
    folder = make_folder(tmp_path / "bert", "bert", layers=1)
    capsys.readouterr()  # transformers' save progress bar
    (tmp_path / "t.conll").write_text(text)
    flags = []
    if dev is not None:
        (tmp_path / "d.conll").write_text(dev)
        flags = ["--dev", str(tmp_path / "d.conll")]
    assert main(["finetune", str(folder), "--task", "tag", "--data", str(tmp_path / "t.conll"),
                 "--out", str(tmp_path / "o"), "--too-long", "error", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkv: error:") and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_conll_byte_order_mark_and_encoding(tmp_path):
    """A UTF-8 byte order mark is dropped (it used to glue onto the first token); bytes that are not UTF-8 are
    one error naming the file and line."""
    from qkv.config import ConfigError

    path = tmp_path / "d.conll"
    path.write_bytes(b"\xef\xbb\xbfalice B-PER\nsmith I-PER\n")
    assert read_conll_lines(path)[0] == [(["alice", "smith"], ["B-PER", "I-PER"])]
    path.write_bytes(b"alice B-PER\ncaf\xe9 O\n")
    with pytest.raises(ConfigError, match=r"d.conll line 2: not UTF-8 text \(byte 0xe9 at column 4\)"):
        read_conll_lines(path)


def test_conll_sentences_keep_their_first_line(tmp_path):
    """-DOCSTART- and runs of blank lines between sentences: each sentence's first token line, counted by
    hand."""

    path = tmp_path / "d.conll"
    path.write_text("-DOCSTART- O\n\nalice B-PER\nsmith I-PER\n\n\n\nrome B-LOC\n-DOCSTART- O\nw1 O\n")
    sentences, lines = read_conll_lines(path)
    assert sentences == [(["alice", "smith"], ["B-PER", "I-PER"]), (["rome"], ["B-LOC"]), (["w1"], ["O"])]
    assert lines == [3, 8, 10]
