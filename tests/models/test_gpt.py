"""GPT: parameter count of GPT-2 small, causality for every positional encoding and backend, the shifted
next-token loss, padding, KV-cache decoding and input checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.models.gpt import GPT, GPTConfig

POSITIONS = ("none", "sinusoidal", "learned", "rope", "alibi")
BACKENDS = ("naive", "fused")


def tiny(**kw) -> GPT:
    cfg = dict(vocab_size=23, n_layers=2, d_model=32, n_heads=4, context_length=16)
    return GPT(GPTConfig(**{**cfg, **kw})).eval()


def test_gpt2_parameter_count():
    # 124,439,808 = the count of Hugging Face's GPT2LMHeadModel (tied LM head counted once):
    # wte 50257*768 + wpe 1024*768 + 12 * (2 LN + c_attn + c_proj + c_fc + c_proj) + ln_f
    d, V, P, L = 768, 50257, 1024, 12
    per_layer = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    by_hand = V * d + P * d + L * per_layer + 2 * d
    assert by_hand == 124_439_808
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = qkv.build("gpt2")
    assert model.num_parameters() == by_hand
    assert model.lm_head.weight is model.tok_emb.weight


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_causality(position, backend):
    # perturbing the tokens after position t leaves the logits at positions <= t unchanged
    model = tiny(position=position, attention=backend)
    ids = torch.randint(0, 23, (2, 10))
    base = model(ids).logits
    for t in (0, 4, 8):
        other = ids.clone()
        other[:, t + 1 :] = torch.randint(0, 23, (2, 9 - t))
        assert not torch.equal(other, ids)
        out = model(other).logits
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], atol=1e-5, rtol=0)
        assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :], atol=1e-4)


def test_loss_is_shifted_next_token_cross_entropy_with_ignore_index():
    model = tiny()
    ids = torch.randint(0, 23, (2, 8))
    labels = ids.clone()
    labels[1, 5:] = -100
    out = model(ids, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, 23)
    target = labels[:, 1:].reshape(-1)
    keep = target != -100
    ref = F.cross_entropy(logits[keep], target[keep])
    torch.testing.assert_close(out.loss, ref)
    assert int(out.n_targets) == 2 * 7 - 3


def test_right_padding_does_not_change_real_tokens():
    for position in POSITIONS:
        model = tiny(position=position)
        ids = torch.randint(0, 23, (1, 6))
        padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
        mask = torch.tensor([[1] * 6 + [0] * 3])
        ref = model(ids).logits
        out = model(padded, attention_mask=mask).logits
        torch.testing.assert_close(out[:, :6], ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_cache_decoding_equals_full_forward(position, backend):
    model = tiny(position=position, attention=backend, n_kv_heads=2)
    ids = torch.randint(0, 23, (2, 9))
    full = model(ids).logits
    cache = model.make_cache(2)
    steps = [model(ids[:, :4], cache=cache).logits]  # prefill 4 tokens, then chunks of 1 and 2
    for s, e in [(4, 5), (5, 7), (7, 8), (8, 9)]:
        steps.append(model(ids[:, s:e], cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)
    assert cache.length == 9


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_left_padded_kv_cache_decoding_equals_full_forward(position, backend):
    # batched decoding of prompts of different lengths: left padding, per-sequence offsets, a mask over
    # cached + new positions; the real tokens' logits equal those of one full forward pass
    model = tiny(position=position, attention=backend)
    ids = torch.randint(3, 23, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    offset = torch.tensor([-3, 0])
    full = model(ids, attention_mask=mask, offset=offset).logits
    cache = model.make_cache(2)
    steps = [model(ids[:, :4], attention_mask=mask[:, :4], cache=cache, offset=offset).logits]
    for t in range(4, 8):
        steps.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache,
                           offset=offset + t).logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("position", POSITIONS)
def test_left_padding_with_per_sequence_offsets(position):
    # a left-padded row with offset -n_pad gives its real tokens the positions 0, 1, ...: the same
    # logits as the unpadded sequence alone
    model = tiny(position=position)
    ids = torch.randint(3, 23, (1, 5))
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], 1)
    batch = torch.cat([padded, torch.randint(3, 23, (1, 7))])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    out = model(batch, attention_mask=mask, offset=torch.tensor([-2, 0])).logits
    torch.testing.assert_close(out[0, 2:], model(ids).logits[0], atol=1e-5, rtol=0)
    assert torch.isfinite(out).all()


def test_tied_weights_and_untied_option():
    model = tiny()
    assert model.lm_head.weight is model.tok_emb.weight
    untied = tiny(tie_embeddings=False)
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert untied.num_parameters() == model.num_parameters() + 23 * 32


def test_init_std_and_scaled_residual_projections():
    model = GPT(GPTConfig(vocab_size=1000, n_layers=4, d_model=256, n_heads=4, context_length=64))
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    w = model.decoder.blocks[0].attn.qkv_proj.weight
    assert w.std().item() == pytest.approx(0.02, rel=0.05)
    for name in ("attn.out_proj", "ffn.down"):
        w = model.decoder.blocks[1].get_submodule(name).weight
        assert w.std().item() == pytest.approx(0.02 / (2 * 4) ** 0.5, rel=0.05)  # GPT-2: 1/sqrt(2 N)
    assert torch.count_nonzero(model.decoder.blocks[0].attn.qkv_proj.bias) == 0


def test_return_attentions_and_last_only():
    model = tiny(attention="fused")
    ids = torch.randint(0, 23, (2, 6))
    out = model(ids, return_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[0]["self"].shape == (2, 4, 6, 6)
    w = out.attentions[0]["self"]
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 6))
    assert torch.equal(w.triu(1), torch.zeros_like(w))  # causal
    torch.testing.assert_close(model(ids, last_only=True).logits, out.logits[:, -1:], atol=1e-5, rtol=0)


def test_bad_inputs_are_clear_errors():
    model = tiny(position="learned")
    with pytest.raises(ValueError, match="token id 23, outside the vocabulary"):
        model(torch.tensor([[1, 23]]))
    with pytest.raises(ValueError, match="token id -1"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(TypeError, match="integer tensor"):
        model(torch.zeros(1, 3))
    with pytest.raises(TypeError, match="int64 or int32"):
        model(torch.zeros(1, 3, dtype=torch.int16))
    assert model(torch.zeros(1, 3, dtype=torch.int32)).logits.shape == (1, 3, 23)
    with pytest.raises(ValueError, match="exceeds the model's context of 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="context"):
        tiny(position="sinusoidal")(torch.zeros(1, 17, dtype=torch.long))
    cache = model.make_cache(1)
    model(torch.zeros(1, 10, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 7, dtype=torch.long), cache=cache)


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_model_runs_and_stays_close(position, backend):
    # a model cast to bf16 (no autocast) must not mix dtypes anywhere (e.g. the fp32 ALiBi table)
    model = tiny(position=position, attention=backend)
    ids = torch.randint(0, 23, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    ref = model(ids, attention_mask=mask).logits
    out = model.to(torch.bfloat16)(ids, attention_mask=mask).logits
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("norm", ["layernorm", "batchnorm"])
def test_gradient_checkpointing_gives_the_same_gradients_and_state(norm):
    model = tiny(norm=norm).train()
    twin = tiny(norm=norm).train()
    twin.load_state_dict(model.state_dict())
    twin.set_gradient_checkpointing(True)
    ids = torch.randint(0, 23, (2, 8))
    model(ids, labels=ids).loss.backward()
    twin(ids, labels=ids).loss.backward()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=n)
    # the recomputed forward must not update BatchNorm's running statistics a second time
    for (n, b), c in zip(model.named_buffers(), twin.buffers()):
        torch.testing.assert_close(c, b, atol=1e-7, rtol=0, msg=n)
    with pytest.raises(ValueError, match="gradient checkpointing cannot be combined with a KV cache"):
        twin(ids, cache=twin.make_cache(2))


def test_attention_mask_of_the_wrong_shape_is_a_clear_error():
    model = tiny()
    with pytest.raises(ValueError, match=r"attention mask has shape \(2, 5\)"):
        model(torch.randint(0, 23, (2, 6)), attention_mask=torch.ones(2, 5))
    cache = model.make_cache(2)
    model(torch.randint(0, 23, (2, 4)), cache=cache)
    with pytest.raises(ValueError, match="cached \\+ new"):  # the mask must cover the cached keys too
        model(torch.randint(0, 23, (2, 1)), cache=cache, attention_mask=torch.ones(2, 1))


@pytest.mark.parametrize("position", ["sinusoidal", "learned", "rope", "alibi"])
def test_position_encoding_takes_effect(position):
    # same weights with and without the encoding: outputs must differ, and only relative encodings
    # (RoPE, ALiBi) give the same logits when the whole sequence is shifted to a later position
    model = tiny(position=position)
    if position == "learned":
        torch.nn.init.normal_(model.decoder.position.weight, std=0.5)
    plain = tiny(position="none")
    plain.load_state_dict(model.state_dict(), strict=False)
    ids = torch.randint(0, 23, (2, 7))
    out = model(ids).logits
    assert not torch.allclose(out, plain(ids).logits, atol=1e-4)
    shifted = model(ids, offset=5).logits
    if position in ("rope", "alibi"):
        torch.testing.assert_close(shifted, out, atol=1e-5, rtol=0)
    else:
        assert not torch.allclose(shifted, out, atol=1e-4)
