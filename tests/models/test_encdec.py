"""EncoderDecoder: the paper's base model's parameter count, decoder causality, teacher forcing,
label smoothing, padding, separate vocabularies, KV-cache decoding and input checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.config import ConfigError
from qkv.models.encdec import EncoderDecoder, EncoderDecoderConfig

POSITIONS = ("none", "sinusoidal", "learned", "rope", "alibi")
BACKENDS = ("naive", "fused")


def tiny(**kw) -> EncoderDecoder:
    cfg = dict(src_vocab_size=21, n_encoder_layers=2, n_decoder_layers=2, d_model=32, n_heads=4, d_ff=64,
               context_length=16, dropout=0.0, label_smoothing=0.0)
    return EncoderDecoder(EncoderDecoderConfig(**{**cfg, **kw})).eval()


def test_transformer_base_parameter_count():
    # Vaswani et al. 2017, base model, computed from the paper's shapes:
    d, d_ff, V, N = 512, 2048, 37000, 6
    attention = 4 * (d * d + d)  # W_Q, W_K, W_V, W_O with biases
    ffn = (d * d_ff + d_ff) + (d_ff * d + d)  # two linears with biases
    layer_norm = 2 * d
    encoder_layer = attention + ffn + 2 * layer_norm  # self-attention, ffn, a norm after each
    decoder_layer = 2 * attention + ffn + 3 * layer_norm  # + cross-attention and its norm
    embeddings = V * d  # one matrix: source, target and output projection share it (section 3.4)
    # Post-LN: no final norm; sinusoidal positions: no parameters
    by_hand = embeddings + N * encoder_layer + N * decoder_layer
    assert by_hand == 63_082_496
    with torch.device("meta"):
        model = qkv.build("transformer-base")
    assert model.num_parameters() == by_hand
    assert model.lm_head.weight is model.src_emb.weight is model.tgt_emb.weight


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("placement", ["pre", "post"])
def test_decoder_causality(position, backend, placement):
    model = tiny(position=position, attention=backend, placement=placement)
    src = torch.randint(0, 21, (2, 7))
    tgt = torch.randint(0, 21, (2, 9))
    base = model(src, decoder_input_ids=tgt).logits
    for t in (0, 5):
        other = tgt.clone()
        other[:, t + 1 :] = (tgt[:, t + 1 :] + 1 + torch.randint(0, 19, (2, 8 - t))) % 21
        out = model(src, decoder_input_ids=other).logits
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], atol=1e-5, rtol=0)
        assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :], atol=1e-4)
    # the source is seen bidirectionally: changing its last token changes the first target logits
    src2 = src.clone()
    src2[:, -1] = (src[:, -1] + 1) % 21
    assert not torch.allclose(model(src2, decoder_input_ids=tgt).logits[:, 0], base[:, 0], atol=1e-5)


def test_teacher_forcing_and_label_smoothing():
    model = tiny(label_smoothing=0.1, bos_token_id=1, pad_token_id=0)
    src = torch.randint(3, 21, (2, 6))
    labels = torch.randint(3, 21, (2, 5))
    labels[1, 3:] = -100
    dec = model.shift_right(labels)
    assert dec.tolist()[0] == [1] + labels[0, :4].tolist()
    assert dec.tolist()[1] == [1] + labels[1, :3].tolist() + [0]
    model.train()  # label smoothing applies to the training loss
    out = model(src, labels=labels)
    keep = labels != -100
    logp = out.logits[keep].float().log_softmax(-1)
    eps, V = 0.1, 21
    # smoothed target: (1 - eps) on the label + eps / V spread over every class (Szegedy et al. 2016)
    ref = -((1 - eps) * logp.gather(1, labels[keep][:, None]).squeeze(1) + eps / V * logp.sum(-1)).mean()
    torch.testing.assert_close(out.loss, ref, atol=1e-5, rtol=0)
    assert int(out.n_targets) == 8
    model.eval()  # evaluation reports the plain cross-entropy
    out = model(src, labels=labels)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits[keep], labels[keep]))


def test_embeddings_are_scaled_by_sqrt_d_model():
    # the scale matters relative to the (unscaled) sinusoidal table added next
    model = tiny(position="sinusoidal")
    ids = torch.randint(0, 21, (1, 4))
    x = model.src_emb(ids) * math.sqrt(32)
    torch.testing.assert_close(model.encode(ids)[0], model.encoder(x).hidden)
    unscaled = tiny(position="sinusoidal", scale_embeddings=False)
    unscaled.load_state_dict(model.state_dict())
    assert not torch.allclose(unscaled.encode(ids)[0], model.encode(ids)[0], atol=1e-4)


@pytest.mark.parametrize("norm", ["layernorm", "batchnorm"])
def test_source_padding_is_ignored(norm):
    model = tiny(norm=norm).train()
    src = torch.randint(3, 21, (2, 5))
    tgt = torch.randint(3, 21, (2, 4))
    mask = torch.tensor([[1] * 5 + [0] * 3] * 2)
    a = torch.cat([src, torch.zeros(2, 3, dtype=torch.long)], 1)
    b = torch.cat([src, torch.randint(3, 21, (2, 3))], 1)
    la = model(a, decoder_input_ids=tgt, attention_mask=mask).logits
    lb = model(b, decoder_input_ids=tgt, attention_mask=mask).logits
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=0)
    if norm == "layernorm":
        torch.testing.assert_close(la, model(src, decoder_input_ids=tgt).logits, atol=1e-5, rtol=0)


def test_separate_vocabularies():
    model = tiny(tgt_vocab_size=13, share_embeddings=False)
    assert model.tgt_emb.weight.shape == (13, 32) and model.src_emb.weight.shape == (21, 32)
    assert model.tgt_emb.weight is not model.src_emb.weight
    out = model(torch.randint(0, 21, (2, 5)), decoder_input_ids=torch.randint(0, 13, (2, 3)))
    assert out.logits.shape == (2, 3, 13)
    with pytest.raises(ValueError, match="decoder_input_ids contains token id 13"):
        model(torch.randint(0, 21, (2, 5)), decoder_input_ids=torch.tensor([[13]]))
    with pytest.raises(ConfigError, match="share_embeddings"):
        tiny(tgt_vocab_size=13, share_embeddings=True)
    with pytest.raises(ConfigError, match="label_smoothing"):
        tiny(label_smoothing=1.5)
    with pytest.raises(ConfigError, match="src_vocab_size must be at least 1, got 0"):
        tiny(src_vocab_size=0)


@pytest.mark.parametrize("position", POSITIONS)
def test_kv_cache_decoding_equals_full_forward(position):
    model = tiny(position=position, n_kv_heads=2)
    src = torch.randint(0, 21, (2, 6))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    tgt = torch.randint(0, 21, (2, 7))
    memory, _ = model.encode(src, mask)
    full, _ = model.decode(tgt, memory, memory_mask=mask)
    cache = model.make_cache(2)
    steps = [model.decode(tgt[:, :3], memory, memory_mask=mask, cache=cache)[0]]
    for t in range(3, 7):
        steps.append(model.decode(tgt[:, t : t + 1], memory, memory_mask=mask, cache=cache)[0])
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


def test_bad_inputs_are_clear_errors():
    model = tiny()
    with pytest.raises(ValueError, match="needs decoder_input_ids or labels"):
        model(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids contains token id 21"):
        model(torch.tensor([[21]]), decoder_input_ids=torch.tensor([[1]]))
    with pytest.raises(ValueError, match="source sequence of length 17 exceeds"):
        model(torch.zeros(1, 17, dtype=torch.long), decoder_input_ids=torch.tensor([[1]]))
    with pytest.raises(ValueError, match="target sequence of length 17 exceeds"):
        model(torch.zeros(1, 3, dtype=torch.long), decoder_input_ids=torch.zeros(1, 17, dtype=torch.long))


def test_memory_mask_of_the_wrong_shape_is_a_clear_error():
    model = tiny()
    memory, _ = model.encode(torch.randint(0, 21, (2, 6)))
    with pytest.raises(ValueError, match=r"memory mask has shape \(2, 5\)"):
        model.decode(torch.randint(0, 21, (2, 3)), memory, memory_mask=torch.ones(2, 5))


@pytest.mark.parametrize("rows", [1, 2, 64])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_output_head_with_logits_bias_equals_the_formula(rows, scale):
    """OutputHead (BART / Marian: final_logits_bias; T5: output_scale) equals (h * s) W^T + b computed in
    float64, for one row and a batched step's rows (beam search's batch x num_beams), and follows a weight
    update."""
    from qkv.models.encdec import OutputHead

    torch.manual_seed(0)
    head = OutputHead(48, 301, scale=scale, logits_bias=True).eval()
    with torch.no_grad():
        head.weight.normal_(0, 0.5)
        head.final_logits_bias.normal_(0, 1.0)
    h = torch.randn(rows, 48)
    ref = (h.double() * scale) @ head.weight.double().t() + head.final_logits_bias.double()
    with torch.no_grad():
        got = head(h)
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-5)
    with torch.no_grad():
        head.weight.mul_(-1.0)
        again = head(h)
    torch.testing.assert_close(again.double(), -ref + 2 * head.final_logits_bias.double(), atol=1e-4,
                               rtol=1e-5)
