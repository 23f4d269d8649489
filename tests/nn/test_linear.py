"""qkv.nn.linear: the oneDNN fp32 CPU path computes the same function and gradients as F.linear, and is
taken only where intended (fp32 CPU, enough rows, no autocast)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qkv.nn import linear as L

needs_onednn = pytest.mark.skipif(not L._probe(), reason="this torch build has no oneDNN fp32 linear")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(4, 50, 48), (130, 48)])
def test_forward_and_grads_equal_f_linear(shape, bias):
    x = torch.randn(*shape, requires_grad=True)
    w = torch.randn(72, 48, requires_grad=True)
    b = torch.randn(72, requires_grad=True) if bias else None
    assert L.use_onednn(x, w)
    g = torch.randn(*shape[:-1], 72)
    ref = F.linear(x, w, b)
    ref_grads = torch.autograd.grad(ref, [x, w] + ([b] if bias else []), g)
    out = L.linear(x, w, b)
    grads = torch.autograd.grad(out, [x, w] + ([b] if bias else []), g)
    assert out.grad_fn is not None and "OneDNN" in type(out.grad_fn).__name__
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-5)


@needs_onednn
def test_only_input_grad_or_only_weight_grad():
    x = torch.randn(80, 16, requires_grad=True)
    w = torch.randn(8, 16)
    (gx,) = torch.autograd.grad(L.linear(x, w).sum(), [x])
    torch.testing.assert_close(gx, w.sum(0).expand(80, 16), atol=1e-5, rtol=1e-5)
    x2, w2 = torch.randn(80, 16), torch.randn(8, 16, requires_grad=True)
    (gw,) = torch.autograd.grad(L.linear(x2, w2).sum(), [w2])
    torch.testing.assert_close(gw, x2.sum(0).expand(8, 16), atol=1e-4, rtol=1e-5)


def test_fast_path_only_where_intended():
    w = torch.randn(8, 16)
    assert not L.use_onednn(torch.randn(3, 16), w)  # a decoding step: few rows, MKL is faster
    assert not L.use_onednn(torch.randn(100, 16, dtype=torch.float64), w.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not L.use_onednn(torch.randn(100, 16), w)
        layer = L.Linear(16, 8)
        assert layer(torch.randn(100, 16)).dtype == torch.bfloat16  # autocast still applies
    old = L.ONEDNN
    try:
        L.ONEDNN = False
        assert not L.use_onednn(torch.randn(100, 16), w)
    finally:
        L.ONEDNN = old


def test_linear_module_is_a_drop_in_nn_linear():
    layer = L.Linear(16, 8)
    assert isinstance(layer, torch.nn.Linear)
    assert list(layer.state_dict()) == ["weight", "bias"]
    x = torch.randn(2, 70, 16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_probe_does_not_touch_the_global_rng(monkeypatch):
    """The first call probes oneDNN; that must not shift torch's RNG (bit-exact resume depends on it)."""
    monkeypatch.setattr(L, "_AVAILABLE", None)
    torch.manual_seed(7)
    L.use_onednn(torch.ones(100, 16), torch.ones(8, 16))
    got = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(got, torch.rand(3))


@pytest.mark.parametrize("narrow_direct", [True, False])
@pytest.mark.parametrize("in_f, out_f", [(48, 16), (16, 48), (24, 24)])
@pytest.mark.parametrize("bias", [True, False])
def test_step_equals_f_linear_in_both_layouts(monkeypatch, narrow_direct, in_f, out_f, bias):
    """The decoding path (narrowing products through the (out, in) weight, the others through the transposed copy;
    or every product through the copy) computes F.linear, with and without the folded query scale."""
    monkeypatch.setattr(L, "STEP_NARROW_DIRECT", narrow_direct)
    torch.manual_seed(0)
    lin = L.Linear(in_f, out_f, bias=bias)
    x = torch.randn(3, in_f)
    with torch.no_grad():
        ref = F.linear(x, lin.weight, lin.bias)
        torch.testing.assert_close(lin.step(x), ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lin.step(x.view(1, 3, in_f)), ref.view(1, 3, out_f), rtol=1e-6, atol=1e-6)
        scaled = ref.clone()
        scaled[:, :8] *= 0.5
        torch.testing.assert_close(lin.step(x, (8, 0.5)), scaled, rtol=1e-6, atol=1e-6)
