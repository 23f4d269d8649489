"""HF BertModel / BertForMaskedLM / BertForSequenceClassification with tiny random configs, saved to
tmp_path (no download), loaded through qkv.from_pretrained: hidden states, pooler output and head logits
equal HF's within 1e-4 (fp32), with padding masks and token types."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import qkv  # noqa: E402
from qkv.checkpoint import CheckpointError  # noqa: E402
from qkv.models.bert import BERT  # noqa: E402

VOCAB = 89


def _cfg(**kw) -> transformers.BertConfig:
    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=48, max_position_embeddings=40, type_vocab_size=3, layer_norm_eps=1e-12,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    base.update(kw)
    return transformers.BertConfig(**base)


def _randomise(model):
    # HF init zeros the biases and sets LayerNorms to (1, 0): perturb every tensor so each one is checked
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _batch():
    # 78 rows: the linears take oneDNN where "auto" does (AVX-512; see qkv.nn.linear)
    x = torch.randint(0, VOCAB, (6, 13))
    mask = torch.ones_like(x)
    mask[1, 9:] = 0
    mask[2, 4:] = 0
    types = torch.randint(0, 3, x.shape)
    return x, mask, types


@pytest.mark.parametrize("kw",
                         [{}, {"hidden_act": "gelu_new", "layer_norm_eps": 1e-6, "num_hidden_layers": 3}],
                         ids=["default", "gelu_new-eps"])
def test_bert_model_hidden_and_pooler_parity(tmp_path, kw):
    hf = _randomise(transformers.BertModel(_cfg(**kw)))
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    assert isinstance(ours, BERT) and ours.config.head == "none" and ours.config.pooler
    assert ours.num_parameters() == hf.num_parameters()
    x, mask, types = _batch()
    with torch.no_grad():
        ref = hf(x, attention_mask=mask, token_type_ids=types)
        got = ours(x, attention_mask=mask, token_type_ids=types)
    assert ref.last_hidden_state.std() > 0.1
    # padded query rows still attend to the real keys in both, so every position is compared
    torch.testing.assert_close(got.last_hidden_state, ref.last_hidden_state, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.pooled, ref.pooler_output, atol=1e-4, rtol=1e-4)


def test_bert_padding_does_not_leak(tmp_path):
    """Changing the padded tokens leaves the real positions unchanged (HF agrees with the baseline)."""
    hf = _randomise(transformers.BertModel(_cfg()))
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    x, mask, types = _batch()
    x2 = torch.where(mask.bool(), x, torch.randint(0, VOCAB, x.shape))
    with torch.no_grad():
        a = ours(x, attention_mask=mask, token_type_ids=types).last_hidden_state
        b = ours(x2, attention_mask=mask, token_type_ids=types).last_hidden_state
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], atol=1e-5, rtol=1e-5)


def test_bert_masked_lm_parity(tmp_path):
    hf = _randomise(transformers.BertForMaskedLM(_cfg()))
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    assert ours.config.head == "mlm" and not ours.config.pooler  # BertForMaskedLM has no pooler
    x, mask, types = _batch()
    labels = torch.where(torch.rand(x.shape) < 0.3, x, torch.full_like(x, -100))
    labels[0, 0] = x[0, 0]
    with torch.no_grad():
        ref = hf(x, attention_mask=mask, token_type_ids=types, labels=labels)
        got = ours(x, attention_mask=mask, token_type_ids=types, labels=labels)
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.loss, ref.loss, atol=1e-5, rtol=1e-5)


def test_bert_for_pretraining_folder_loads_mlm(tmp_path):
    """BertForPreTraining (MLM + next-sentence head): the MLM part loads, the NSP head is skipped."""
    hf = _randomise(transformers.BertForPreTraining(_cfg()))
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    assert ours.config.head == "mlm" and ours.config.pooler
    x, mask, types = _batch()
    with torch.no_grad():
        ref = hf(x, attention_mask=mask, token_type_ids=types)
        got = ours(x, attention_mask=mask, token_type_ids=types)
    torch.testing.assert_close(got.logits, ref.prediction_logits, atol=1e-4, rtol=1e-4)


def test_bert_sequence_classification_parity(tmp_path):
    hf = _randomise(transformers.BertForSequenceClassification(_cfg(num_labels=5)))
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    assert ours.config.head == "classify" and ours.config.num_labels == 5
    x, mask, types = _batch()
    with torch.no_grad():
        ref = hf(x, attention_mask=mask, token_type_ids=types).logits
        got = ours(x, attention_mask=mask, token_type_ids=types).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_bert_pytorch_model_bin_with_legacy_names(tmp_path):
    """pytorch_model.bin with TF-era LayerNorm gamma/beta names and a position_ids buffer."""
    hf = _randomise(transformers.BertModel(_cfg()))
    hf.config.save_pretrained(tmp_path)
    state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
             for k, v in hf.state_dict().items()}
    state["embeddings.position_ids"] = torch.arange(40).unsqueeze(0)
    torch.save(state, tmp_path / "pytorch_model.bin")
    ours = qkv.from_pretrained(tmp_path)
    x, mask, types = _batch()
    with torch.no_grad():
        ref = hf(x, attention_mask=mask, token_type_ids=types).last_hidden_state
        got = ours(x, attention_mask=mask, token_type_ids=types).last_hidden_state
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kw, match", [
    ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
    ({"hidden_act": "silu"}, "hidden_act"),
    ({"is_decoder": True}, "is_decoder"),
])
def test_bert_unsupported_config_is_refused(tmp_path, kw, match):
    hf = transformers.BertModel(_cfg(**kw))
    hf.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=match):
        qkv.from_pretrained(tmp_path)


@pytest.mark.parametrize("head", ["classify", "tag", "mlm"])
def test_training_step_with_unpadding_matches_hf_gradients(tmp_path, head):
    """Training mode runs the token-wise layers on the real tokens only (BERT.unpad_in_training): the loss,
    the real tokens' logits and every parameter's gradient equal HF's (which computes every position), and
    the same model with unpadding off; only the hidden states of padded positions differ (zeros)."""
    cls = {"classify": transformers.BertForSequenceClassification,
           "tag": transformers.BertForTokenClassification, "mlm": transformers.BertForMaskedLM}[head]
    hf = _randomise(cls(_cfg(num_labels=3))).train()
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path).train()
    padded = qkv.from_pretrained(tmp_path).train()
    padded.unpad_in_training = False
    x, mask, types = _batch()
    x = x.clamp_min(1)  # id 0 is HF's padding_idx, whose embedding row HF never trains: none in real text
    if head == "classify":
        labels = torch.tensor([0, 2, 1, 1, 0, 2])
    else:
        hi = 3 if head == "tag" else VOCAB
        labels = torch.where(mask.bool(), torch.randint(0, hi, x.shape), torch.full_like(x, -100))
    ref = hf(x, attention_mask=mask, token_type_ids=types, labels=labels)
    ref.loss.backward()
    for model in (ours, padded):
        got = model(x, attention_mask=mask, token_type_ids=types, labels=labels)
        got.loss.backward()
        torch.testing.assert_close(got.loss, ref.loss, atol=1e-5, rtol=1e-5)
        real = mask.bool() if head != "classify" else slice(None)
        torch.testing.assert_close(got.logits[real], ref.logits[real], atol=1e-4, rtol=1e-4)
    pad_rows = ours(x, attention_mask=mask, token_type_ids=types).last_hidden_state[~mask.bool()]
    assert pad_rows.abs().max() == 0  # unpadded: padded positions are never computed
    assert (padded(x, attention_mask=mask, token_type_ids=types).last_hidden_state[~mask.bool()].abs().max()
            > 0)
    # gradients of the three models, by qkv parameter (HF's query/key/value are qkv's fused qkv_proj rows)
    hf_layer0 = hf.bert.encoder.layer[0]
    ref_qkv = torch.cat([getattr(hf_layer0.attention.self, n).weight.grad for n in ("query", "key", "value")])
    ref_ffn = hf_layer0.intermediate.dense.weight.grad
    ref_emb = hf.bert.embeddings.word_embeddings.weight.grad
    ref_pos = hf.bert.embeddings.position_embeddings.weight.grad
    assert ref_qkv.abs().max() > 1e-3
    for model in (ours, padded):
        blk = model.encoder.blocks[0]
        torch.testing.assert_close(blk.attn.qkv_proj.weight.grad, ref_qkv, atol=1e-5, rtol=1e-3)
        torch.testing.assert_close(blk.ffn.up.weight.grad, ref_ffn, atol=1e-5, rtol=1e-3)
        torch.testing.assert_close(model.tok_emb.weight.grad, ref_emb, atol=1e-5, rtol=1e-3)
        pos_grad = model.encoder.position.weight.grad
        torch.testing.assert_close(pos_grad[: ref_pos.shape[0]], ref_pos, atol=1e-5, rtol=1e-3)
    for (n, a), b in zip(ours.named_parameters(), padded.parameters()):
        if a.grad is not None or b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-3, msg=n)


def test_unpadding_without_padding_and_in_eval_is_the_plain_path(tmp_path):
    """No padding in the batch (nothing to skip) or eval mode: the plain padded path, bit for bit."""
    hf = _randomise(transformers.BertModel(_cfg()))
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    plain = qkv.from_pretrained(tmp_path)
    plain.unpad_in_training = False
    x, mask, types = _batch()
    full = torch.ones_like(mask)
    for train, m in ((True, full), (False, mask)):
        ours.train(train), plain.train(train)
        with torch.no_grad():
            assert torch.equal(ours(x, attention_mask=m, token_type_ids=types).last_hidden_state,
                               plain(x, attention_mask=m, token_type_ids=types).last_hidden_state)
