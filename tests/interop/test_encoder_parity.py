"""RoBERTa / XLM-R / DistilBERT (and BERT's token classifier) with tiny random configs saved to tmp_path (no
download), loaded through qkv.from_pretrained: last hidden state, pooled output and head logits equal HF's
within 1e-4 (fp32) with padding masks (right and, for RoBERTa's position ids, left padding); and the other
direction: a qkv BERT exported as each family's HF folder gives the same outputs in transformers."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import qkv  # noqa: E402
from qkv.interop.bert import export_bert  # noqa: E402
from qkv.interop.distilbert import export_distilbert  # noqa: E402
from qkv.interop.roberta import export_roberta  # noqa: E402
from qkv.models.bert import BERT  # noqa: E402

VOCAB = 83
PAD = 1  # RoBERTa's padding_idx: positions start at PAD + 1


def _roberta_cfg(cls=None, **kw):
    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=48,
                max_position_embeddings=24, type_vocab_size=1, layer_norm_eps=1e-5, pad_token_id=PAD,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    base.update(kw)
    return (cls or transformers.RobertaConfig)(**base)


def _distil_cfg(**kw):
    base = dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=48, max_position_embeddings=24,
                dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, pad_token_id=0)
    base.update(kw)
    return transformers.DistilBertConfig(**base)


def _bert_cfg(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=48,
                max_position_embeddings=24, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    base.update(kw)
    return transformers.BertConfig(**base)


def _randomise(model):
    # HF init zeros biases and sets LayerNorms to (1, 0): perturb every tensor so each one is checked
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _batch(pad_id: int, left: bool = False):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(3, VOCAB, (5, 11), generator=g)
    mask = torch.ones_like(x)
    for row, n in ((1, 7), (2, 3), (4, 10)):
        if left:
            mask[row, : 11 - n] = 0
        else:
            mask[row, n:] = 0
    return x.masked_fill(mask == 0, pad_id), mask


def _compare(ours, hf, x, mask, *, pooled=False, logits=False):
    with torch.no_grad():
        ref = hf(input_ids=x, attention_mask=mask)
        got = ours(x, attention_mask=mask)
    keep = mask.bool()
    if logits:
        assert ref.logits.std() > 1e-3
        r, g = (ref.logits[keep], got.logits[keep]) if ref.logits.dim() == 3 else (ref.logits, got.logits)
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)
        return
    assert ref.last_hidden_state.std() > 0.1
    # HF gives RoBERTa's pads the padding_idx position, ours the next ones: only real positions are compared
    torch.testing.assert_close(got.last_hidden_state[keep], ref.last_hidden_state[keep], atol=1e-4, rtol=1e-4)
    if pooled:  # the pooler reads position 0: a pad in left-padded rows, so only rows starting with a token
        rows = keep[:, 0]
        torch.testing.assert_close(got.pooled[rows], ref.pooler_output[rows], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("left", [False, True], ids=["right-pad", "left-pad"])
@pytest.mark.parametrize("cls", ["RobertaModel", "XLMRobertaModel"])
def test_roberta_base_model_parity(tmp_path, cls, left):
    config_cls = transformers.XLMRobertaConfig if cls.startswith("XLM") else transformers.RobertaConfig
    hf = _randomise(getattr(transformers, cls)(_roberta_cfg(config_cls)))
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    assert isinstance(ours, BERT) and ours.config.head == "none" and ours.config.pooler
    assert ours.config.position_offset == 2 and ours.config.context_length == 22
    assert ours.num_parameters() == hf.num_parameters()
    x, mask = _batch(PAD, left)
    _compare(ours, hf, x, mask, pooled=True)


@pytest.mark.parametrize("cls, head", [("RobertaForSequenceClassification", "classify"),
                                       ("RobertaForTokenClassification", "tag"),
                                       ("RobertaForMaskedLM", "mlm")])
def test_roberta_heads_parity(tmp_path, cls, head):
    hf = _randomise(getattr(transformers, cls)(_roberta_cfg(num_labels=3)))
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    assert ours.config.head == head
    _compare(ours, hf, *_batch(PAD), logits=True)


def test_roberta_context_is_max_positions_minus_offset(tmp_path):
    _randomise(transformers.RobertaModel(_roberta_cfg())).save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    ours(torch.full((1, 22), 5))  # 22 = 24 positions - offset 2
    with pytest.raises(ValueError, match="context"):
        ours(torch.full((1, 23), 5))


@pytest.mark.parametrize("cls, head",
                         [("DistilBertModel", "none"), ("DistilBertForSequenceClassification", "classify"),
                                       ("DistilBertForTokenClassification", "tag"),
                          ("DistilBertForMaskedLM", "mlm")])
def test_distilbert_parity(tmp_path, cls, head):
    hf = _randomise(getattr(transformers, cls)(_distil_cfg(num_labels=4)))
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    assert ours.config.head == head and ours.config.type_vocab_size == 0
    _compare(ours, hf, *_batch(0), logits=head != "none")


def test_bert_token_classification_parity(tmp_path):
    hf = _randomise(transformers.BertForTokenClassification(_bert_cfg(num_labels=5)))
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    assert ours.config.head == "tag" and not ours.config.pooler
    _compare(ours, hf, *_batch(0), logits=True)


@pytest.mark.parametrize("family, head, auto", [
    ("bert", "classify", "AutoModelForSequenceClassification"),
    ("bert", "tag", "AutoModelForTokenClassification"),
    ("roberta", "classify", "AutoModelForSequenceClassification"),
    ("roberta", "tag", "AutoModelForTokenClassification"), ("roberta", "none", "AutoModel"),
    ("distilbert", "classify", "AutoModelForSequenceClassification"),
    ("distilbert", "tag", "AutoModelForTokenClassification"),
])
def test_export_round_trip(tmp_path, family, head, auto):
    """Load a HF folder, export it with a new head, read it back in transformers: same outputs."""
    src, out = tmp_path / "src", tmp_path / "out"
    hf_src = {"bert": lambda: transformers.BertModel(_bert_cfg()),
              "roberta": lambda: transformers.RobertaModel(_roberta_cfg()),
              "distilbert": lambda: transformers.DistilBertModel(_distil_cfg())}[family]()
    _randomise(hf_src).save_pretrained(src)
    base = qkv.from_pretrained(src)
    cfg = base.config
    if head != "none":
        cfg.head, cfg.num_labels, cfg.pooler = head, 3, head == "classify" or cfg.pooler
    ours = BERT(cfg)
    ours.load_state_dict(base.state_dict(), strict=False)
    _randomise(ours)
    names = {0: "neg", 1: "neu", 2: "pos"}
    export = {"bert": export_bert, "roberta": export_roberta, "distilbert": export_distilbert}[family]
    import json

    export(ours, out, base_config=json.loads((src / "config.json").read_text()), id2label=names)
    hf = getattr(transformers, auto).from_pretrained(out).eval()
    if head != "none":
        assert hf.config.id2label == names
    x, mask = _batch(0 if family == "distilbert" else PAD if family == "roberta" else 0)
    _compare(ours, hf, x, mask, logits=head != "none")
    again = qkv.from_pretrained(out)  # and back into qkv
    assert again.config.head == head
    with torch.no_grad():
        torch.testing.assert_close(again(x, attention_mask=mask).last_hidden_state,
                                   ours(x, attention_mask=mask).last_hidden_state)
