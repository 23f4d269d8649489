"""Gradient accumulation is a bigger batch (per-token normalisation), checkpointing changes nothing,
bf16 autocast trains, fp16 is refused on CPU."""

import pytest
import torch
import torch.nn.functional as F

from qkv.config import ConfigError
from qkv.train import Trainer


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def reference_grads(model, batch):
    """Independent reference: per-token cross-entropy summed over all targets / their count."""
    model.zero_grad(set_to_none=True)
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                         ignore_index=-100, reduction="sum")
    (ce / (targets != -100).sum()).backward()
    return grads_of(model)


def test_accumulate_4x8_equals_batch_32_with_padding(make_gpt, toy_data, cfg_factory):
    big = toy_data.batch(0, 32)
    micro = [toy_data.batch(i, 8) for i in range(4)]
    # the premise: micro-batches differ in padded length and in target counts
    assert len({b["input_ids"].shape[1] for b in micro}) > 1
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in micro]
    assert len(set(counts)) > 1

    ref_model = make_gpt()
    ref = reference_grads(ref_model, big)

    m32 = make_gpt()
    Trainer(m32, cfg_factory(batch_size=32, grad_accum=1), toy_data).compute_gradients(step=1)
    m8 = make_gpt()
    loss, n, _, _ = Trainer(m8, cfg_factory(batch_size=8, grad_accum=4), toy_data).compute_gradients(step=1)
    assert n == sum(counts)
    g32, g8 = grads_of(m32), grads_of(m8)
    assert g32.keys() == g8.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(g32[k], ref[k], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(g8[k], ref[k], rtol=1e-5, atol=1e-7)

    # the test can fail: averaging per micro-batch (the HF #34191 bug) gives different gradients
    naive = make_gpt()
    for b in micro:
        (naive(**b).loss / 4).backward()
    worst = max(float((p.grad - ref[k]).abs().max() / ref[k].abs().max())
                for k, p in naive.named_parameters() if p.grad is not None)
    assert worst > 1e-3


def test_step_loss_is_token_weighted(make_gpt, toy_data, cfg_factory):
    model = make_gpt()
    loss, n, _, _ = Trainer(model, cfg_factory(batch_size=8, grad_accum=4),
                            toy_data).compute_gradients(step=1)
    ref = make_gpt()
    with torch.no_grad():
        want = ref(**toy_data.batch(0, 32)).loss
    assert loss == pytest.approx(float(want), rel=1e-5)


def test_gradient_checkpointing_same_gradients(make_gpt, toy_data, cfg_factory):
    plain, ckpt = make_gpt(), make_gpt()
    Trainer(plain, cfg_factory(batch_size=8, grad_accum=2), toy_data).compute_gradients(step=1)
    tr = Trainer(ckpt, cfg_factory(batch_size=8, grad_accum=2, grad_checkpointing=True), toy_data)
    assert all(s.gradient_checkpointing for s in [ckpt.decoder])
    tr.compute_gradients(step=1)
    a, b = grads_of(plain), grads_of(ckpt)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-8)


def test_bf16_autocast_close_to_fp32(make_gpt, toy_data, cfg_factory):
    m32, m16 = make_gpt(), make_gpt()
    l32, *_ = Trainer(m32, cfg_factory(batch_size=16), toy_data).compute_gradients(step=1)
    l16, *_ = Trainer(m16, cfg_factory(batch_size=16, precision="bf16"), toy_data).compute_gradients(step=1)
    assert l16 != l32  # autocast really ran in bf16
    assert l16 == pytest.approx(l32, rel=2e-2)
    g32, g16 = grads_of(m32), grads_of(m16)
    assert all(g.dtype == torch.float32 for g in g16.values())  # master weights/grads stay fp32
    cos = torch.nn.functional.cosine_similarity(torch.cat([g.flatten() for g in g32.values()]),
                                                torch.cat([g.flatten() for g in g16.values()]), dim=0)
    assert cos > 0.99


def test_fp16_on_cpu_is_a_clear_error(make_gpt, toy_data, cfg_factory):
    with pytest.raises(ConfigError, match="fp16 needs a CUDA GPU"):
        Trainer(make_gpt(), cfg_factory(precision="fp16", device="cpu"), toy_data)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_gradscaler_trains_on_cuda(make_gpt, toy_data, cfg_factory):
    model = make_gpt()
    tr = Trainer(model, cfg_factory(precision="fp16", device="cuda", max_steps=20, lr=3e-3), toy_data)
    s = tr.fit()
    assert tr.precision.scaler is not None and s["final_loss"] < 3.0
    l32, *_ = Trainer(make_gpt(), cfg_factory(device="cuda", precision="fp32"),
                      toy_data).compute_gradients(step=1)
    l16, *_ = Trainer(make_gpt(), cfg_factory(precision="fp16", device="cuda"),
                      toy_data).compute_gradients(step=1)
    assert l16 == pytest.approx(l32, rel=1e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_accumulation_on_cuda_bf16(make_gpt, toy_data, cfg_factory):
    m32 = make_gpt()
    Trainer(m32, cfg_factory(batch_size=32, device="cuda", precision="fp32"),
            toy_data).compute_gradients(step=1)
    m8 = make_gpt()
    Trainer(m8, cfg_factory(batch_size=8, grad_accum=4, device="cuda", precision="fp32"),
            toy_data).compute_gradients(step=1)
    for (_k, a), b in zip(grads_of(m32).items(), grads_of(m8).values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
