"""`qkv embed`: mean-pooled / [CLS] sentence embeddings equal a transformers reference (AutoModel + masked
mean + L2 norm) for BERT, RoBERTa and DistilBERT folders built here; --query ranks an input line first."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent / "finetune"))  # the tiny-folder builders of the recipe tests
from _encoders import make_folder, sentiment_rows  # noqa: E402

from qkv.cli.main import main  # noqa: E402
from qkv.embed import run  # noqa: E402


def _reference(folder, texts, pooling):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    hf = transformers.AutoModel.from_pretrained(folder).eval()
    pad = hf.config.pad_token_id or 0
    rows = []
    for t in texts:  # one at a time: no padding at all in the reference
        ids = torch.tensor([tok.encode(t).ids])
        with torch.no_grad():
            h = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
        v = h.mean(0) if pooling == "mean" else h[0]
        rows.append(torch.nn.functional.normalize(v, dim=-1))
    assert pad is not None
    return torch.stack(rows).numpy()


@pytest.mark.parametrize("family, pooling", [("bert", "mean"), ("roberta", "mean"), ("distilbert", "cls")])
def test_embeddings_equal_transformers_pooling(tmp_path, family, pooling):
    folder = make_folder(tmp_path / family, family)
    texts = [r["text"] for r in sentiment_rows(13, 5)]  # lengths differ: batches are padded
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    out = tmp_path / "emb.npy"
    run(str(folder), str(tmp_path / "texts.txt"), out=str(out), pooling=pooling, batch_size=4, progress=False)
    emb = np.load(out)
    ref = _reference(folder, texts, pooling)
    assert emb.shape == ref.shape and emb.dtype == np.float32
    np.testing.assert_allclose(emb, ref, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)


def test_query_mode_and_errors(tmp_path, capsys):
    folder = make_folder(tmp_path / "bert", "bert", layers=1)
    texts = [r["text"] for r in sentiment_rows(9, 6)]
    (tmp_path / "texts.txt").write_text("\n".join(texts))
    assert main(["embed", str(folder), "--input", str(tmp_path / "texts.txt"), "--query", texts[4], "--top-k",
                 "3", "--no-progress"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and "line 5:" in lines[0] and "1.0000" in lines[0]
    (tmp_path / "bad.txt").write_text("w1\n\nw2\n")
    assert main(["embed", str(folder), "--input", str(tmp_path / "bad.txt"), "--out",
                 str(tmp_path / "e.npy")]) == 2
    assert "line 2 is empty" in capsys.readouterr().err
    assert main(["embed", str(folder), "--input", str(tmp_path / "texts.txt")]) == 2
    assert "--out" in capsys.readouterr().err


def _sentence_transformers_folder(folder, max_seq_length, extra_module=None):
    """What sentence-transformers saves beside the encoder: its cut length, its pooling and its module
    list."""
    import json

    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize"}]
    if extra_module:
        modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": extra_module})
    (folder / "modules.json").write_text(json.dumps(modules))


def test_a_sentence_transformers_folder_cuts_texts_at_its_max_seq_length(tmp_path, capsys):
    """sentence-transformers cuts every text at max_seq_length (often below the context): the reference is the
    transformers tokenizer with truncation=True, max_length=8, a masked mean and an L2 norm."""
    folder = make_folder(tmp_path / "bert", "bert", layers=1)
    _sentence_transformers_folder(folder, 8)
    texts = [" ".join(f"w{i}" for i in range(k)) for k in (3, 12, 30)]
    (tmp_path / "t.txt").write_text("\n".join(texts) + "\n")
    lines = run(str(folder), str(tmp_path / "t.txt"), out=str(tmp_path / "e.npy"), progress=False)
    assert "2 text(s) longer than the folder's max_seq_length of 8 tokens were truncated" in lines[0]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    hf = transformers.AutoModel.from_pretrained(folder).eval()
    ref = []
    for t in texts:
        b = tok([t], truncation=True, max_length=8, return_tensors="pt")
        with torch.no_grad():
            ref.append(torch.nn.functional.normalize(hf(**b).last_hidden_state[0].mean(0), dim=-1).numpy())
    np.testing.assert_allclose(np.load(tmp_path / "e.npy"), np.stack(ref), atol=1e-5)
    _sentence_transformers_folder(folder, 8, extra_module="sentence_transformers.models.Dense")
    assert (main(["embed", str(folder), "--input", str(tmp_path / "t.txt"), "--out", str(tmp_path / "d.npy")])
            == 2)
    assert "sentence_transformers.models.Dense, which qkv embed does not apply" in capsys.readouterr().err


def test_one_row_per_newline_not_per_unicode_line_break(tmp_path):
    """str.splitlines also breaks at a form feed, U+2028 or NEL inside a line: 3 lines gave 6 rows."""
    from qkv.embed import read_texts

    (tmp_path / "t.txt").write_text("w1 w2\x0cw3\nw4 w5\u2028w6\r\nw7\x85w8\n", encoding="utf-8")
    assert read_texts(tmp_path / "t.txt") == ["w1 w2\x0cw3", "w4 w5\u2028w6", "w7\x85w8"]
    (tmp_path / "u.txt").write_text("a\nb", encoding="utf-8")  # no newline at the end
    assert read_texts(tmp_path / "u.txt") == ["a", "b"]
