"""BERT: parameter count of BERT-base, the MLM and classification heads, padding, input checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.models.bert import BERT, BERTConfig


def tiny(**kw) -> BERT:
    cfg = dict(vocab_size=30, n_layers=2, d_model=32, n_heads=4, context_length=12, head="mlm")
    return BERT(BERTConfig(**{**cfg, **kw})).eval()


def test_bert_base_parameter_count():
    # 109,482,240 = Hugging Face BertModel (bert-base-uncased) with its pooler:
    # embeddings (word 30522 + position 512 + type 2) * 768 + LayerNorm; 12 Post-LN layers; pooler.
    d, L = 768, 12
    embeddings = (30522 + 512 + 2) * d + 2 * d
    per_layer = 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d
    pooler = d * d + d
    by_hand = embeddings + L * per_layer + pooler
    assert by_hand == 109_482_240
    with torch.device("meta"):
        model = qkv.build("bert-base")
    assert model.num_parameters() == by_hand
    assert model.encoder.final_norm is None  # Post-LN: no final norm


def test_mlm_head_formula_and_loss():
    model = tiny()
    ids = torch.randint(0, 30, (2, 7))
    labels = torch.full_like(ids, -100)
    labels[0, 2], labels[1, 5] = 4, 9
    out = model(ids, labels=labels)
    h = out.last_hidden_state
    # transform (dense, exact gelu, LayerNorm) then the decoder tied to the word embeddings, plus a bias
    t = F.layer_norm(F.gelu(model.mlm_dense(h)), (32,), model.mlm_norm.weight, model.mlm_norm.bias, 1e-12)
    ref_logits = t @ model.tok_emb.weight.T + model.mlm_decoder.bias
    torch.testing.assert_close(out.logits, ref_logits, atol=1e-5, rtol=0)
    ref_loss = F.cross_entropy(torch.stack([out.logits[0, 2], out.logits[1, 5]]), torch.tensor([4, 9]))
    torch.testing.assert_close(out.loss, ref_loss)
    assert int(out.n_targets) == 2
    assert model.mlm_decoder.weight is model.tok_emb.weight


def test_classification_head_and_pooler():
    model = tiny(head="classify", num_labels=3)
    ids = torch.randint(0, 30, (4, 6))
    labels = torch.tensor([0, 2, 1, 2])
    out = model(ids, labels=labels)
    pooled = torch.tanh(model.pooler(out.last_hidden_state[:, 0]))  # [CLS] = position 0
    torch.testing.assert_close(out.pooled, pooled)
    torch.testing.assert_close(out.logits, model.classifier(pooled))
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, labels))
    assert out.logits.shape == (4, 3)


@pytest.mark.parametrize("position", ["none", "sinusoidal", "learned", "rope", "alibi"])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm", "batchnorm"])
def test_padding_does_not_change_real_tokens(position, norm):
    # the encoder is bidirectional: padded keys must be masked out, and BatchNorm must not count them
    model = tiny(position=position, norm=norm).train()  # train mode: BatchNorm uses batch statistics
    ids = torch.randint(1, 30, (2, 5))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[:, 5:] = 0
    a = torch.cat([ids, torch.zeros(2, 3, dtype=torch.long)], 1)
    b = torch.cat([ids, torch.randint(1, 30, (2, 3))], 1)  # different padding tokens
    torch.manual_seed(1)
    ha = model(a, attention_mask=mask).last_hidden_state
    torch.manual_seed(1)
    hb = model(b, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(ha[:, :5], hb[:, :5], atol=1e-5, rtol=0)
    if norm != "batchnorm":  # BatchNorm couples tokens: the unpadded batch has other statistics
        torch.testing.assert_close(ha[:, :5], model(ids).last_hidden_state, atol=1e-5, rtol=0)


def test_token_types():
    model = tiny()
    ids = torch.randint(0, 30, (1, 6))
    tt = torch.tensor([[0, 0, 0, 1, 1, 1]])
    a = model(ids).last_hidden_state
    torch.testing.assert_close(model(ids, token_type_ids=torch.zeros_like(ids)).last_hidden_state, a)
    assert not torch.allclose(model(ids, token_type_ids=tt).last_hidden_state, a, atol=1e-4)
    with pytest.raises(ValueError, match="token_type_ids contains token id 2"):
        model(ids, token_type_ids=tt + 1)


def test_bad_inputs_are_clear_errors():
    model = tiny()
    with pytest.raises(ValueError, match="token id 30, outside the vocabulary"):
        model(torch.tensor([[1, 30]]))
    with pytest.raises(ValueError, match="exceeds the model's context of 12"):
        model(torch.zeros(1, 13, dtype=torch.long))
    with pytest.raises(qkv.ConfigError, match="head"):
        tiny(head="ner")
    with pytest.raises(qkv.ConfigError, match="pooler"):
        tiny(head="classify", pooler=False)
    with pytest.raises(qkv.ConfigError, match="vocab_size must be at least 1, got 0"):
        tiny(vocab_size=0)


def test_attentions_are_bidirectional_and_ignore_padding():
    model = tiny(attention="naive")
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    w = model(torch.randint(0, 30, (1, 6)), attention_mask=mask, return_attentions=True).attentions[0]["self"]
    assert w.shape == (1, 4, 6, 6)
    assert torch.equal(w[..., 4:], torch.zeros_like(w[..., 4:]))
    assert (w[..., :4] > 0).all()  # every real key is visible to every query, also "future" ones
