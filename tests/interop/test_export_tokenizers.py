"""`qkv export` and the tokenizer a user's model needs: a BERT folder's vocab.txt, the <bos> a ListOps run
puts first for its classifier, a qkv folder that carries a Hugging Face tokenizer. Each checked against
transformers reading the source (or the ids qkv's task feeds the model), not against files named here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import qkv
from qkv.cli.main import main
from qkv.run import load_model_any, load_run_task

transformers = pytest.importorskip("transformers")

TEXTS = ["the cat sat", "A Dog ran far", "an unknown zebra", "the the cat"]
WORDS = ["the", "cat", "sat", "a", "dog", "ran", "far", "an", "un", "##known"]


def export(capsys, *args: object) -> tuple[int, str, str]:
    code = main(["export", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_bert_folder_with_only_vocab_txt_keeps_its_tokenizer(tmp_path, capsys):
    cfg = transformers.BertConfig(vocab_size=5 + len(WORDS), hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=64, num_labels=2)
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(cfg).save_pretrained(tmp_path / "src")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (tmp_path / "src" / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (tmp_path / "src" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "BertTokenizer", "do_lower_case": True}))
    code, printed, _ = export(capsys, tmp_path / "src", tmp_path / "out")
    assert code == 0 and "tokenizer files" in printed
    ours = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")(TEXTS)["input_ids"]
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "src")(TEXTS)["input_ids"]
    assert ours == theirs
    assert any(i not in (1, 2, 3) for row in ours for i in row)  # words, not only [UNK] between [CLS] [SEP]


@pytest.fixture(scope="module")
def listops_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("listops") / "run"
    assert main(["train", "listops", "--out", str(out), "--max-steps", "2", "model.n_layers=1",
                 "model.d_model=32", "model.n_heads=2", "task.max_len=24", "task.min_len=4",
                 "task.max_depth=2", "train.batch_size=4", "train.warmup=1", "eval.n=4", "eval.samples=0",
                 "--no-progress"]) == 0
    return out


def test_listops_run_exports_the_bos_its_classifier_reads(listops_run, tmp_path, capsys):
    assert export(capsys, listops_run, tmp_path / "out")[0] == 0
    task = load_run_task(listops_run)
    assert task.pools_first_token  # a BERT run: the task puts <bos> first, as [CLS]
    examples = task.eval_examples(6)
    fed = task.collate(examples)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    got = hf_tok([e for e, _ in examples], padding=True, return_tensors="pt")
    assert got["input_ids"].tolist() == fed["input_ids"].tolist()
    assert got["attention_mask"].tolist() == fed["attention_mask"].tolist()
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    ours = load_model_any(listops_run).eval()
    with torch.no_grad():
        ref = ours(input_ids=fed["input_ids"], attention_mask=fed["attention_mask"]).logits
        out = hf(input_ids=got["input_ids"], attention_mask=got["attention_mask"]).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def _hf_bpe_tokenizer() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def test_qkv_folder_with_a_hugging_face_tokenizer_keeps_it(tmp_path, capsys):
    # what `qkv finetune --task chat` writes from a qkv source: save_pretrained + the source's HF tokenizer
    hf_tok = _hf_bpe_tokenizer()
    qkv.build("gpt-nano", vocab_size=len(hf_tok)).save_pretrained(tmp_path / "src")
    hf_tok.save_pretrained(tmp_path / "src")
    code, printed, err = export(capsys, tmp_path / "src", tmp_path / "out")
    assert code == 0 and "no tokenizer found" not in err
    assert "the source's tokenizer files" in printed
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "src" / name).read_bytes()
    reread = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert reread(TEXTS)["input_ids"] == hf_tok(TEXTS)["input_ids"]


def test_qkv_bert_folder_with_a_bpe_tokenizer_reads_bos_first(tmp_path, capsys):
    # no run to ask: a model that pools its first token reads <bos> there (qkv's tasks put it first)
    from qkv.tasks.tokenizers import BPETokenizer, save_tokenizer

    tok = BPETokenizer.train([" ".join(TEXTS) * 3], vocab_size=280, min_frequency=1)
    qkv.build("bert-tiny", vocab_size=tok.vocab_size, head="classify", num_labels=2).save_pretrained(
        tmp_path / "src")
    save_tokenizer(tok, tmp_path / "src")
    assert export(capsys, tmp_path / "src", tmp_path / "out")[0] == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in TEXTS:
        ids = hf_tok(text)["input_ids"]
        assert ids == [tok.bos_id, *tok.encode(text)]
        assert hf_tok.decode(ids, skip_special_tokens=True) == tok.decode(tok.encode(text))
