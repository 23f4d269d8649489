"""`qkv finetune --task classify`: a tiny random BERT learns a separable synthetic task (>= 95% dev accuracy),
the saved folder gives the same logits in transformers (AutoModelForSequenceClassification) and in qkv; bad
data is one clear line and exit 2; macro-F1 agrees with scikit-learn."""

from __future__ import annotations

import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _encoders import make_folder, sentiment_rows, write_csv  # noqa: E402

import qkv  # noqa: E402
from qkv.cli.main import main  # noqa: E402
from qkv.finetune.classify import scores  # noqa: E402


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("bert"), "bert")


def _encode(folder, texts):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    encs = tok.encode_batch(texts)
    T = max(len(e.ids) for e in encs)
    ids = torch.tensor([e.ids + [0] * (T - len(e.ids)) for e in encs])
    mask = torch.tensor([[1] * len(e.ids) + [0] * (T - len(e.ids)) for e in encs])
    return ids, mask


def test_classify_learns_and_round_trips(bert, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", sentiment_rows(240, 1))
    dev_rows = sentiment_rows(80, 2)
    dev = write_csv(tmp_path / "dev.csv", dev_rows)
    out = tmp_path / "out"
    rc = main(["finetune", str(bert), "--task", "classify", "--data", str(train), "--dev", str(dev), "--out",
               str(out),
               "--epochs", "6", "--no-progress", "train.lr=2e-3", "train.warmup=0.1",
               "train.tensorboard=false"])
    assert rc == 0
    report = capsys.readouterr().out
    result = json.loads((out / "finetune.json").read_text())
    assert result["dev"]["accuracy"] >= 0.95, report
    assert (out / "confusion.png").stat().st_size > 1000
    assert sum(map(sum, result["confusion"])) == 80

    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(hf).__name__ == "BertForSequenceClassification"
    assert hf.config.id2label == {0: "neg", 1: "pos"}
    ours = qkv.from_pretrained(out)
    ids, mask = _encode(out, [r["text"] for r in dev_rows])  # the tokenizer travelled with the model
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    gold = torch.tensor([r["label"] == "pos" for r in dev_rows]).long()
    assert (ref.argmax(-1) == gold).float().mean() == pytest.approx(result["dev"]["accuracy"])


@pytest.mark.parametrize("family", ["roberta", "distilbert"])
def test_pairs_jsonl_ids_and_truncation(family, tmp_path):
    """Text pairs from JSONL, integer labels, one text over the context (truncated and counted), one step;
    the saved folder is the family's sequence classifier with the same logits in transformers."""
    folder = make_folder(tmp_path / family, family, max_pos=16)
    rng = random.Random(0)
    rows = [{"a": " ".join(rng.choices(["w1", "w2", "good"], k=3)), "b": "w3 bad", "y": i % 3}
                for i in range(12)]
    rows[5]["a"] = " ".join(["w7"] * 40)  # over the 16-token context
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert main(["finetune", str(folder), "--task", "classify", "--data", str(data), "--dev", str(data),
                 "--out", str(out), "--text-column", "a", "--text-pair-column", "b", "--label-column", "y",
                 "--no-progress", "train.max_steps=1", "train.plot=false", "train.tensorboard=false"]) == 0
    result = json.loads((out / "finetune.json").read_text())
    assert result["truncated"] == {"train": 1, "dev": 1} and result["labels"] == ["0", "1", "2"]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    ours = qkv.from_pretrained(out)
    assert ours.config.head == "classify" and ours.config.num_labels == 3
    ids = torch.randint(4, 30, (3, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows, flags, message", [
    ([{"text": "w1 good", "label": "pos"}], ["--label-column", "y"],
     "no label column 'y' (columns: text, label)"),
    ([{"text": "w1 good", "label": "pos"}, {"text": "", "label": "neg"}], [], "line 3: empty text ('text')"),
    ([{"text": "w1 good", "label": "pos"}, {"text": "w2", "label": "neg"}], ["--dev", "DEV"],
     "label 'maybe' does not occur in the training data"),
    ([{"text": "w1 " * 80, "label": "pos"}, {"text": "w2", "label": "neg"}], ["--too-long", "error"],
     "1 example(s) longer than the model's context of 64"),
])
def test_bad_data_is_one_line_and_exit_2(bert, tmp_path, capsys, rows, flags, message):
    data = write_csv(tmp_path / "t.tsv", rows, sep="\t")
    dev = write_csv(tmp_path / "dev.csv", [{"text": "w3", "label": "maybe"}])
    flags = [str(dev) if f == "DEV" else f for f in flags]
    assert main(["finetune", str(bert), "--task", "classify", "--data", str(data), "--out",
                 str(tmp_path / "o"), "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkv: error:") and message in err and len(err.splitlines()) == 1


def test_scores_match_scikit_learn():
    metrics = pytest.importorskip("sklearn.metrics")
    rng = random.Random(3)
    for _ in range(20):
        gold = [rng.randrange(4) for _ in range(30)]
        pred = [rng.randrange(3) for _ in range(30)]  # class 3 never predicted
        s = scores(gold, pred, 4)
        assert s["accuracy"] == pytest.approx(metrics.accuracy_score(gold, pred))
        assert s["macro_f1"] == pytest.approx(metrics.f1_score(gold, pred, average="macro"))


def test_same_seed_same_weights_and_resume(bert, tmp_path):
    """One seed, the same run (head init, data order, dropout); --resume continues from the last
    checkpoint."""
    from safetensors.torch import load_file

    data = write_csv(tmp_path / "t.csv", sentiment_rows(40, 4))
    common = ["--task", "classify", "--data", str(data), "--no-progress", "train.plot=false",
              "train.tensorboard=false", "train.batch_size=8",
              "train.schedule=constant", "train.warmup=0"]  # a resume with more steps keeps the same LRs
    for name in ("a", "b"):
        assert main(["finetune", str(bert), "--out", str(tmp_path / name), *common, "train.max_steps=4"]) == 0
    a, b = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["finetune", str(bert), "--out", str(tmp_path / "c"), *common, "train.max_steps=2"]) == 0
    assert main(["finetune", str(bert), "--out", str(tmp_path / "c"), *common, "--resume",
                 "train.max_steps=4"]) == 0
    assert "resumed from" in (tmp_path / "c" / "train.log").read_text()
    c = load_file(str(tmp_path / "c" / "model.safetensors"))
    assert all(torch.allclose(a[k], c[k], atol=1e-6) for k in a)  # 2 + 2 steps == 4 steps


@pytest.mark.parametrize("content, message", [
    # a row with more fields than the header: the label used to become a text fragment, or (a row with empty
    # fields) an AttributeError traceback
    ('text,label\n"w1 good",pos\nw2 bad,neg,extra\n',
     "t.csv line 3: 3 fields, the header has 2 (quote texts that "
     "contain commas)"),
    ("text,label\nw1 good,pos\nw2 bad,neg\n,,x\n", "t.csv line 4: 3 fields, the header has 2"),
    ('text,label\n"w1 good",pos\n"w2 bad"\n', "t.csv line 3: 1 fields, the header has 2"),
    ("text,label\nw1 good,pos\nw2 caf\xe9,neg\n".encode("latin-1"),
     "t.csv line 3: not UTF-8 text (byte 0xe9"),
    ("text,label\nw1 good,pos\n" + "w1 " * 80 + ",neg\n",
     "t.csv line 3: 1 example(s) longer than the model's context of 64 tokens (this is the first, 82 "
     "tokens)"),
])
def test_csv_rows_are_checked_against_the_header(bert, tmp_path, capsys, content, message):
    data = tmp_path / "t.csv"
    data.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["finetune", str(bert), "--task", "classify", "--data", str(data), "--out",
                 str(tmp_path / "o"), "--no-progress", "--too-long", "error"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkv: error:") and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_byte_order_mark_and_unicode_digits_in_labels(tmp_path):
    """A CSV saved with a UTF-8 byte order mark (Excel) has the header 'text', not '\\ufefftext'; a label such
    as '²' (a digit to str.isdigit, not to int) is a name, not an id."""
    from qkv.finetune.data import read_records

    data = tmp_path / "bom.csv"
    data.write_bytes(b"\xef\xbb\xbftext,label\nw1 good,1\nw2 bad,\xc2\xb2\n")
    records = read_records(data)
    assert [r for _, r in records] == [{"text": "w1 good", "label": "1"}, {"text": "w2 bad", "label": "²"}]
    from qkv.finetune.classify import label_set

    assert label_set(["1", "²"], None)[0] == {"1": 0, "²": 1}


def test_json_labels_are_strings_or_integers(bert, tmp_path, capsys):
    """JSON labels 1 and 1.0 are one class (it trained '0', '1', '1.0'), said in a warning; a list, an object,
    a boolean or a fractional float is an error naming its line (it trained classes such as '[1]')."""
    data = tmp_path / "d.jsonl"
    rows = [{"text": "w1 good", "label": 1}, {"text": "w2 bad", "label": 0},
            {"text": "w1 good", "label": 1.0}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows * 2))
    out = tmp_path / "out"
    assert main(["finetune", str(bert), "--task", "classify", "--data", str(data), "--out", str(out),
                 "--no-progress", "train.max_steps=1", "train.plot=false", "train.tensorboard=false"]) == 0
    assert json.loads((out / "finetune.json").read_text())["labels"] == ["0", "1"]
    err = capsys.readouterr().err
    assert f"qkv: warning: {data}: 2 label(s) written as floats equal to integers (line 3 first)" in err
    for bad, shown in (([1], "[1]"), ({"a": 1}, '{"a": 1}'), (True, "true"), (0.5, "0.5")):
        rows = [{"text": "w1 good", "label": 1}, {"text": "w2 bad", "label": bad}]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert main(["finetune", str(bert), "--task", "classify", "--data", str(data), "--out",
                     str(tmp_path / "o2"), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"qkv: error: {data} line 2: label {shown} is a {type(bad).__name__}; labels must be " \
                      "strings or integers", err
        assert not (tmp_path / "o2").exists()
