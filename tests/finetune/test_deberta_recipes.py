"""The encoder commands on a tiny random DeBERTa-v3-shaped folder (built here, word-level tokenizer.json):
`qkv finetune --task classify` and `--task tag` learn the synthetic tasks and write folders transformers
reads as DebertaV2For{Sequence,Token}Classification with the same logits; `qkv embed` equals transformers'
masked mean pooling."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from _encoders import conll_sentences, make_folder, sentiment_rows, write_conll, write_csv  # noqa: E402

import qkv  # noqa: E402
from qkv.cli.main import main  # noqa: E402


@pytest.fixture(scope="module")
def deberta(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("deberta"), "deberta")


def _encode(folder, texts, pretokenized=False):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    encs = tok.encode_batch(texts, is_pretokenized=pretokenized)
    T = max(len(e.ids) for e in encs)
    ids = torch.tensor([e.ids + [0] * (T - len(e.ids)) for e in encs])
    mask = torch.tensor([[1] * len(e.ids) + [0] * (T - len(e.ids)) for e in encs])
    return ids, mask


def _same_logits(out, auto_class, expect, ids, mask):
    hf = getattr(transformers, auto_class).from_pretrained(out).eval()
    assert type(hf).__name__ == expect
    ours = qkv.from_pretrained(out)
    assert type(ours).__name__ == "DeBERTa"
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)  # every position, padding included
    return hf, ref


def test_classify(deberta, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", sentiment_rows(200, 1))
    dev_rows = sentiment_rows(60, 2)
    dev = write_csv(tmp_path / "dev.csv", dev_rows)
    out = tmp_path / "out"
    assert main(["finetune", str(deberta), "--task", "classify", "--data", str(train), "--dev", str(dev),
                 "--out", str(out), "--epochs", "8", "--no-progress", "train.lr=2e-3", "train.warmup=0.1",
                 "train.tensorboard=false"]) == 0
    report = capsys.readouterr().out
    result = json.loads((out / "finetune.json").read_text())
    assert "deberta-v2" in report and result["dev"]["accuracy"] >= 0.9, report
    ids, mask = _encode(out, [r["text"] for r in dev_rows])  # the tokenizer travelled with the model
    hf, ref = _same_logits(out, "AutoModelForSequenceClassification", "DebertaV2ForSequenceClassification",
                           ids, mask)
    assert hf.config.id2label == {0: "neg", 1: "pos"} and hf.config.pooler_hidden_act == "gelu"
    gold = torch.tensor([r["label"] == "pos" for r in dev_rows]).long()
    assert (ref.argmax(-1) == gold).float().mean() == pytest.approx(result["dev"]["accuracy"])


def test_tag(deberta, tmp_path, capsys):
    train = write_conll(tmp_path / "train.conll", conll_sentences(160, 1))
    dev_sentences = conll_sentences(40, 2)
    dev = write_conll(tmp_path / "dev.conll", dev_sentences)
    out = tmp_path / "out"
    assert main(["finetune", str(deberta), "--task", "tag", "--data", str(train), "--dev", str(dev),
                 "--out", str(out), "--epochs", "6", "--no-progress", "train.lr=2e-3", "train.warmup=0.1",
                 "train.tensorboard=false"]) == 0
    report = capsys.readouterr().out
    result = json.loads((out / "finetune.json").read_text())
    assert result["dev"]["f1"] >= 0.85, report
    ids, mask = _encode(out, [[w for w, _ in s] for s in dev_sentences], pretokenized=True)
    hf, _ = _same_logits(out, "AutoModelForTokenClassification", "DebertaV2ForTokenClassification", ids, mask)
    assert hf.config.id2label[0] == "O" and len(hf.config.id2label) == 7


def test_embed(deberta, tmp_path, capsys):
    from tokenizers import Tokenizer

    texts = [r["text"] for r in sentiment_rows(11, 5)]  # lengths differ: the batches are padded
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    out = tmp_path / "emb.npy"
    assert main(["embed", str(deberta), "--input", str(tmp_path / "texts.txt"), "--out", str(out),
                 "--batch-size", "4", "--query", texts[3], "--top-k", "1"]) == 0
    assert "line 4:" in capsys.readouterr().out  # a text is its own nearest neighbour
    emb = np.load(out)
    tok = Tokenizer.from_file(str(deberta / "tokenizer.json"))
    hf = transformers.AutoModel.from_pretrained(deberta).eval()
    rows = []
    for t in texts:  # one at a time: no padding in the reference
        ids = torch.tensor([tok.encode(t).ids])
        with torch.no_grad():
            h = hf(input_ids=ids).last_hidden_state[0]
        rows.append(torch.nn.functional.normalize(h.mean(0), dim=-1))
    np.testing.assert_allclose(emb, torch.stack(rows).numpy(), atol=1e-5)


def test_a_sentencepiece_only_folder(tmp_path, capsys):
    """A folder with only DeBERTa-v3's spm.model is refused with the one-line conversion; after it
    (transformers writes tokenizer.json) `qkv embed` reads the texts as transformers' SentencePiece tokenizer
    does."""
    spm = pytest.importorskip("sentencepiece")
    import io
    import shutil

    folder = make_folder(tmp_path / "deb", "deberta", layers=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    texts = [r["text"] for r in sentiment_rows(40, 7)]
    buf = io.BytesIO()
    # DeBERTa-v3's special pieces and ids; 60 pieces + [MASK] fit the model's 65
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=buf, vocab_size=60, hard_vocab_limit=False, pad_id=0,
        bos_id=1, eos_id=2, unk_id=3, pad_piece="[PAD]", bos_piece="[CLS]", eos_piece="[SEP]",
        unk_piece="[UNK]")
    (folder / "spm.model").write_bytes(buf.getvalue())
    (tmp_path / "texts.txt").write_text("\n".join(texts[:6]) + "\n")
    out = tmp_path / "emb.npy"
    args = ["embed", str(folder), "--input", str(tmp_path / "texts.txt"), "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "spm.model" in err and "AutoTokenizer.from_pretrained(folder).save_pretrained(folder)" in err
    assert not out.exists()

    # the reference: the pieces' own ids
    sp = spm.SentencePieceProcessor(model_file=str(folder / "spm.model"))
    # the conversion the error names
    transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(folder)
    assert (folder / "tokenizer.json").is_file()
    assert main(args) == 0
    hf = transformers.AutoModel.from_pretrained(folder).eval()
    rows = []
    for t in texts[:6]:
        ids = torch.tensor([[1, *sp.encode(t), 2]])  # [CLS] pieces [SEP]
        with torch.no_grad():
            rows.append(torch.nn.functional.normalize(hf(input_ids=ids).last_hidden_state[0].mean(0), dim=-1))
    np.testing.assert_allclose(np.load(out), torch.stack(rows).numpy(), atol=1e-5)
    shutil.rmtree(folder)
