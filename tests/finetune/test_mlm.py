"""Masked-LM training: BERT's masking rule (15%, 80/10/10, whole words, specials never chosen) measured on
large batches; `qkv export` writes the MLM head of BERT / RoBERTa / DeBERTa-v2 folders so that transformers'
*ForMaskedLM loads it with equal logits; `qkv finetune --task mlm` trains a BERT folder's encoder under a new
MLM head (dev masked-token loss falls; OUT loads in BertForMaskedLM with qkv's logits); `qkv predict --text`
fills [MASK] with transformers' probabilities; `task: mlm` trains with `qkv train`; bad input is one line."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import qkv  # noqa: E402
from qkv.cli.main import main  # noqa: E402
from qkv.tasks.mlm import MaskingRule, mask_tokens, word_ids_from_starts  # noqa: E402

WORDS = ["the", "cat", "dog", "sat", "on", "mat", "a", "red", "blue", "ran", "to", "house", "big", "small",
         "bird", "flew", "over", "tree", "##s", "##ed"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def save_wordpiece(folder):
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = transformers.BertTokenizerFast(vocab=vocab)
    assert tok("the cats").input_ids == [2, 5, 6, 23, 3]
    tok.save_pretrained(folder)


def perturb(model, scale=0.1):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.add_(scale * torch.randn_like(p))
    return model


def bert_config(**kw):
    return transformers.BertConfig(vocab_size=len(SPECIAL) + len(WORDS), hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                   **kw)


# -- the masking rule ----------------------------------------------------------------------------------------
def test_masking_rates_and_specials():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 1000, (400, 250), generator=g)
    maskable = torch.rand(ids.shape, generator=g) > 0.1  # 10% "special": never chosen
    inp, labels = mask_tokens(ids, maskable, MaskingRule(), mask_id=3, vocab_size=1000, generator=g)
    chosen = labels != -100
    assert not chosen[~maskable].any()
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(inp[~chosen], ids[~chosen])
    rate = chosen.sum() / maskable.sum()
    masked = (inp[chosen] == 3).float().mean()
    same = (inp[chosen] == ids[chosen]).float().mean()
    other = ((inp[chosen] != 3) & (inp[chosen] != ids[chosen])).float().mean()
    # ~ 90k maskable tokens: three standard errors of each share are below 0.005
    assert abs(rate - 0.15) < 0.005 and abs(masked - 0.8) < 0.01
    assert abs(same - (0.1 + 0.1 / 1000)) < 0.01 and abs(other - 0.1 * 999 / 1000) < 0.01


def test_whole_word_masking_chooses_words():
    g = torch.Generator().manual_seed(1)
    starts = torch.rand((300, 120), generator=g) < 0.4
    starts[:, 0] = True
    maskable = torch.ones_like(starts)
    maskable[:, 0] = maskable[:, -1] = False  # [CLS] ... [SEP]
    words = word_ids_from_starts(starts, maskable)
    assert (words[:, 0] == -1).all() and (words[:, -1] == -1).all()
    ids = torch.randint(10, 500, starts.shape, generator=g)
    _, labels = mask_tokens(ids, maskable, MaskingRule(whole_word=True), 3, 500, g, words)
    chosen = labels != -100
    word_rates = []
    for r in range(words.shape[0]):
        for w in words[r].unique().tolist():
            if w < 0:
                continue
            picked = chosen[r][words[r] == w]
            assert picked.all() or not picked.any()  # a word is chosen whole or not at all
            word_rates.append(bool(picked.all()))
    assert abs(sum(word_rates) / len(word_rates) - 0.15) < 0.01


def test_bad_masking_rule():
    from qkv.config import ConfigError

    for rule in (MaskingRule(rate=0.0), MaskingRule(rate=1.0), MaskingRule(mask_share=0.95)):
        with pytest.raises(ConfigError):
            rule.validate()


# -- exporting the head ------------------------------------------------------------------------------------
def _roberta():
    return transformers.RobertaForMaskedLM(transformers.RobertaConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=40, pad_token_id=1))


def _deberta():
    return transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(
        vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=40, relative_attention=True, position_biased_input=False,
        pos_att_type=["p2c", "c2p"], max_relative_positions=16, position_buckets=8, norm_rel_ebd="layer_norm",
        share_att_key=True, type_vocab_size=0))


@pytest.mark.parametrize("make, cls", [
    (lambda: transformers.BertForMaskedLM(bert_config()), "BertForMaskedLM"),
    (_roberta, "RobertaForMaskedLM"),
    (_deberta, "DebertaV2ForMaskedLM"),
    (lambda: transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(
        vocab_size=40, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=40)),
     "DistilBertForMaskedLM"),
])
def test_export_writes_the_mlm_head(tmp_path, capsys, make, cls):
    torch.manual_seed(0)
    hf = perturb(make().eval())
    hf.save_pretrained(tmp_path / "src")
    ours = qkv.from_pretrained(tmp_path / "src")
    assert ours.config.head == "mlm"
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [cls]
    back = getattr(transformers, cls).from_pretrained(tmp_path / "out").eval()
    ids = torch.tensor([[2, 5, 7, 9, 11, 3], [2, 8, 4, 4, 6, 3]])
    with torch.no_grad():
        ref, got, again = hf(ids).logits, ours(ids).logits, back(ids).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(again, ref, atol=1e-5, rtol=1e-5)


# -- finetune --task mlm, predict --text ---------------------------------------------------------------------
TEXT = ["the cat sat on the mat", "the dog ran to the house", "a red bird flew over the tree",
        "the big dog sat on the mat", "a small cat ran to the tree", "the blue bird sat on the house"]


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    perturb(transformers.BertModel(bert_config()).eval()).save_pretrained(d)
    save_wordpiece(d)
    return d


@pytest.fixture(scope="module")
def tuned(bert_folder, tmp_path_factory):
    d = tmp_path_factory.mktemp("mlm")
    (d / "train.txt").write_text("\n".join(TEXT * 20) + "\n")
    (d / "dev.txt").write_text("\n".join(TEXT * 4) + "\n")
    out = d / "out"
    assert main(["finetune", str(bert_folder), "--task", "mlm", "--data", str(d / "train.txt"), "--dev",
                 str(d / "dev.txt"), "--out", str(out), "--epochs", "4", "--whole-word", "--no-progress",
                 "train.lr=3e-3", "train.batch_size=16", "train.warmup=0"]) == 0
    return out


def test_finetune_mlm_learns_and_exports(tuned):
    result = json.loads((tuned / "finetune.json").read_text())
    assert result["recipe"] == "mlm" and result["whole_word"]
    assert result["dev"]["mlm_loss"] < 0.8 * result["dev_before"]["mlm_loss"]
    assert result["dev"]["mlm_accuracy"] > result["dev_before"]["mlm_accuracy"] + 0.2
    back = transformers.BertForMaskedLM.from_pretrained(tuned).eval()
    ours = qkv.from_pretrained(tuned)
    ids = torch.tensor([[2, 5, 6, 4, 9, 3]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, back(ids).logits, atol=1e-4, rtol=1e-4)


def test_predict_fills_mask_as_transformers(tuned, capsys):
    capsys.readouterr()
    assert main(["predict", str(tuned), "--text", "the cat [MASK] on the mat", "--top-k", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "the cat [MASK] on the mat" and len(lines) == 4
    tok = transformers.AutoTokenizer.from_pretrained(tuned)
    model = transformers.BertForMaskedLM.from_pretrained(tuned).eval()
    enc = tok("the cat [MASK] on the mat", return_tensors="pt")
    with torch.no_grad():
        probs = model(**enc).logits[0, 3].softmax(-1)
    top = probs.topk(3)
    for line, p, i in zip(lines[1:], top.values, top.indices):
        assert line.split()[-1] == tok.convert_ids_to_tokens(int(i))
        assert float(line.split()[2]) == pytest.approx(float(p), abs=1e-4)


def test_mlm_bad_input(bert_folder, tuned, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    cases = [
        (["finetune", str(bert_folder), "--task", "mlm", "--data", str(empty), "--out", str(tmp_path / "o")],
         "no text"),
        (["predict", str(tuned), "--text", "no mask here"], "has no [MASK] to fill"),
        (["predict", str(bert_folder), "--text", "the [MASK]"], "--text fills masks with a masked-LM folder"),
        (["finetune", str(bert_folder), "--task", "mlm", "--data", str(empty), "--out", str(tmp_path / "o"),
          "--mask-rate", "1.5"], "mask rate must be in (0, 1)"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("qkv: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_train_task_mlm(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("\n".join(TEXT * 30) + "\n")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model:\n  preset: bert-tiny\ntask:\n  name: mlm\n  path: {text}\n  context: 24\n"
                   f"  whole_word: true\ntrain:\n  max_steps: 40\n  batch_size: 16\n  lr: 3.0e-3\n"
                   f"  log_every: 40\n  out_dir: {tmp_path / 'run'}\neval:\n  n: 20\n  samples: 0\n")
    assert main(["train", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "mlm_loss=" in out and "mlm_accuracy=" in out
    from qkv.run import load_model_any, load_run_task

    task = load_run_task(tmp_path / "run")
    b = task.batch(0, 8)
    chosen = b["labels"] != -100
    assert chosen.any() and not chosen[b["attention_mask"] == 0].any()
    assert torch.equal(task.batch(0, 8)["input_ids"], b["input_ids"])  # the same masks for the same batch
    model = load_model_any(tmp_path / "run")
    torch.manual_seed(0)
    fresh = type(model)(model.config)  # the same model before any training
    assert task.evaluate(model)["mlm_loss"] < task.evaluate(fresh)["mlm_loss"] - 0.3
    # the run fills <mask> through qkv generate, and exports with its head (transformers' logits = qkv's)
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "run"), "--prompt", "the <mask>at sat"]) == 0
    filled = capsys.readouterr().out.strip().splitlines()[-1]
    assert "<mask>" not in filled and filled.startswith("the ") and filled.endswith("at sat")
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    back = transformers.BertForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    ids = task.batch(1, 4)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model.eval()(ids).logits, atol=1e-4, rtol=1e-4)
