"""Every variant of every family runs forward and backward: position (5) x placement (2) x norm (3) x
attention backend (2) x ffn (4) = 240 combinations for GPT, BERT (MLM head) and EncoderDecoder, with
tiny sizes, dropout on, and padding masks for the encoders. Each run must give a finite loss and a
finite, non-zero gradient for every parameter that takes part in the loss."""

from __future__ import annotations

import itertools

import pytest
import torch

from qkv.models.bert import BERT, BERTConfig
from qkv.models.encdec import EncoderDecoder, EncoderDecoderConfig
from qkv.models.gpt import GPT, GPTConfig

POSITIONS = ("none", "sinusoidal", "learned", "rope", "alibi")
PLACEMENTS = ("pre", "post")
NORMS = ("layernorm", "rmsnorm", "batchnorm")
BACKENDS = ("naive", "fused")
FFNS = ("relu", "gelu", "gelu_tanh", "swiglu")
COMBOS = list(itertools.product(POSITIONS, PLACEMENTS, NORMS, BACKENDS, FFNS))
IDS = ["-".join(c) for c in COMBOS]

B, T, V = 2, 6, 17


def block_fields(position, placement, norm, attention, ffn):
    return dict(position=position, placement=placement, norm=norm, attention=attention, ffn=ffn,
                d_model=16, n_heads=2, d_ff=24, dropout=0.1, attn_dropout=0.1)


def padding_mask():
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 4:] = 0  # the second sequence has two padding tokens
    return mask


def run_gpt(fields):
    model = GPT(GPTConfig(vocab_size=V, n_layers=2, context_length=T, n_kv_heads=1, **fields))
    ids = torch.randint(0, V, (B, T))
    return model, model(ids, labels=ids), set()


def run_bert(fields):
    model = BERT(BERTConfig(vocab_size=V, n_layers=2, context_length=T, head="mlm", **fields))
    ids = torch.randint(0, V, (B, T))
    labels = torch.full_like(ids, -100)
    labels[:, 1], labels[0, 5] = ids[:, 1], ids[0, 5]
    out = model(ids, attention_mask=padding_mask(), labels=labels)
    return model, out, {"pooler.weight", "pooler.bias"}  # the pooler only feeds the classification head


def run_encdec(fields):
    cfg = EncoderDecoderConfig(src_vocab_size=V, n_encoder_layers=1, n_decoder_layers=1, context_length=T,
                               label_smoothing=0.1, **fields)
    model = EncoderDecoder(cfg)
    src, labels = torch.randint(3, V, (B, T)), torch.randint(3, V, (B, T - 1))
    labels[1, 3:] = -100
    return model, model(src, labels=labels, attention_mask=padding_mask()), set()


@pytest.mark.parametrize("family", ["gpt", "bert", "encdec"])
@pytest.mark.parametrize("combo", COMBOS, ids=IDS)
def test_forward_backward(family, combo):
    run = {"gpt": run_gpt, "bert": run_bert, "encdec": run_encdec}[family]
    model, out, unused = run(block_fields(*combo))
    assert model.training
    assert out.loss is not None and torch.isfinite(out.loss), f"loss {out.loss}"
    assert torch.isfinite(out.logits).all()
    out.loss.backward()
    for name, p in model.named_parameters():
        if name in unused:
            assert p.grad is None, f"{name} should not take part in the loss"
            continue
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
        assert p.grad.abs().sum() > 0, f"{name} has an all-zero gradient"
