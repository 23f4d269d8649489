"""Norms against their formulas; BatchNorm against torch.nn.BatchNorm1d over the real tokens only."""

from __future__ import annotations

import pytest
import torch

from qkv.nn.norm import BatchNorm, LayerNorm, RMSNorm, build_norm, frozen_running_stats


def randomize(m):
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    return m


def test_layernorm_formula():
    ln = randomize(LayerNorm(8, eps=1e-5))
    x = torch.randn(2, 3, 8, dtype=torch.float64) * 3 + 1
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)  # biased variance, as in the paper
    ref = (x - mean) / torch.sqrt(var + 1e-5) * ln.weight.double() + ln.bias.double()
    torch.testing.assert_close(ln(x.float(), keep=torch.ones(2, 3, dtype=torch.bool)).double(), ref,
                               atol=1e-5, rtol=0)
    assert LayerNorm(8, bias=False).bias is None


def test_rmsnorm_formula():
    rms = randomize(RMSNorm(8, eps=1e-6))
    x = torch.randn(2, 3, 8, dtype=torch.float64) * 3 + 1
    ref = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-6) * rms.weight.double()
    torch.testing.assert_close(rms(x.float()).double(), ref, atol=1e-5, rtol=0)
    y = rms(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16


def batch_with_padding(pad_value):
    x = torch.randn(3, 5, 4) * 2 + 0.5
    keep = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    return x.masked_fill(~keep[..., None], pad_value), keep


def test_batchnorm_statistics_ignore_padding():
    bn, ref = randomize(BatchNorm(4)), torch.nn.BatchNorm1d(4)
    with torch.no_grad():
        ref.weight.copy_(bn.weight)
        ref.bias.copy_(bn.bias)
    x, keep = batch_with_padding(0.0)
    y = bn(x, keep)
    y_ref = ref(x[keep])  # BatchNorm1d over the real tokens only: (N_real, C)
    torch.testing.assert_close(y[keep], y_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(bn.running_mean, ref.running_mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(bn.running_var, ref.running_var, atol=1e-6, rtol=0)

    # whatever sits in the padded positions, the real tokens' outputs do not change
    x2 = x.clone()
    x2[~keep] = 1e4 * torch.randn(int((~keep).sum()), 4)
    bn2 = randomize(BatchNorm(4))
    bn2.load_state_dict({**bn.state_dict(), "running_mean": torch.zeros(4), "running_var": torch.ones(4)})
    torch.testing.assert_close(bn2(x2, keep)[keep], y[keep], atol=1e-5, rtol=0)


def test_batchnorm_without_mask_uses_every_token():
    bn, ref = BatchNorm(4), torch.nn.BatchNorm1d(4)
    x = torch.randn(2, 6, 4)
    torch.testing.assert_close(bn(x), ref(x.reshape(-1, 4)).view(2, 6, 4), atol=1e-5, rtol=0)


def test_batchnorm_eval_uses_running_statistics():
    bn, ref = randomize(BatchNorm(4)), torch.nn.BatchNorm1d(4)
    with torch.no_grad():
        ref.weight.copy_(bn.weight)
        ref.bias.copy_(bn.bias)
    for _ in range(3):
        x, keep = batch_with_padding(7.0)
        bn(x, keep)
        ref(x[keep])
    bn.eval()
    ref.eval()
    x = torch.randn(2, 3, 4)
    torch.testing.assert_close(bn(x), ref(x.reshape(-1, 4)).view(2, 3, 4), atol=1e-5, rtol=0)
    # in eval each token is normalised alone: the batch composition no longer matters
    torch.testing.assert_close(bn(x[:1]), bn(x)[:1])


def test_batchnorm_needs_two_real_tokens():
    bn = BatchNorm(4)
    keep = torch.zeros(2, 3, dtype=torch.bool)
    keep[0, 0] = True
    with pytest.raises(ValueError, match="at least 2 real tokens"):
        bn(torch.randn(2, 3, 4), keep)


def test_build_norm():
    assert isinstance(build_norm("layernorm", 4), LayerNorm)
    assert isinstance(build_norm("rmsnorm", 4), RMSNorm)
    assert isinstance(build_norm("batchnorm", 4), BatchNorm)
    with pytest.raises(ValueError, match="unknown norm"):
        build_norm("groupnorm", 4)


def test_frozen_running_stats_normalises_but_does_not_update():
    # used by gradient checkpointing: the recomputed forward must not apply the momentum update again
    bn = BatchNorm(4)
    x, keep = batch_with_padding(0.0)
    with frozen_running_stats():
        y = bn(x, keep)
    assert torch.equal(bn.running_mean, torch.zeros(4)) and torch.equal(bn.running_var, torch.ones(4))
    torch.testing.assert_close(y, BatchNorm(4)(x, keep))
    bn(x, keep)
    assert not torch.equal(bn.running_mean, torch.zeros(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rmsnorm_equals_the_formula_in_every_dtype(dtype):
    """fp32 and fp64 take the fused torch.rms_norm kernel, bf16 the written-out path: both are the formula,
    computed here in float64 (and HF's LlamaRMSNorm is checked in tests/interop/test_llama.py)."""
    torch.manual_seed(0)
    norm = RMSNorm(32, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
    x = (torch.randn(4, 5, 32) * 3).to(dtype)
    xd, wd = x.double(), norm.weight.double()
    want = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * wd
    tol = {torch.bfloat16: 2e-2, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    got = norm(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rmsnorm_long_input_is_torch_rms_norm_bit_for_bit(dtype):
    """A long prompt's rows: the same values as torch.rms_norm bit for bit, contiguous or strided input, and
    the formula in float64; with autograd the gradients flow."""
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = (torch.randn(2, 600, 64) * 3).to(dtype)
    for xx in (x, x.transpose(0, 1)):
        with torch.no_grad():
            got = norm(xx)
        assert torch.equal(got, torch.rms_norm(xx, (64,), norm.weight, 1e-5))
        xd, wd = xx.double(), norm.weight.double()
        want = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * wd
        tol = {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    xg = x.clone().requires_grad_()
    y = norm(xg)
    assert torch.equal(y.detach(), got.transpose(0, 1))
    y.sum().backward()
    assert xg.grad is not None and norm.weight.grad is not None
