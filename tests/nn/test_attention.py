"""scaled_dot_product_attention and MultiHeadAttention against independent references:
an explicit per-query loop, torch's own SDPA / nn.MultiheadAttention, and float64 gradcheck."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.nn.attention import MultiHeadAttention, causal_mask, scaled_dot_product_attention

BACKENDS = ("naive", "fused")


def qkv_tensors(B=2, H=4, Hkv=None, Tq=5, Tk=None, D=8, dtype=torch.float32, grad=False):
    Hkv, Tk = Hkv or H, Tk or Tq
    q = torch.randn(B, H, Tq, D, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, Hkv, Tk, D, dtype=dtype, requires_grad=grad)
    v = torch.randn(B, Hkv, Tk, D, dtype=dtype, requires_grad=grad)
    return q, k, v


def loop_reference(q, k, v, *, visible, bias=None, scale=None):
    """Attention written one (batch, head, query) at a time in float64.
    visible(b, h, i, j) -> bool says whether query i may see key j; no visible key -> zeros."""
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(B, H, Tq, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            hk = h // (H // Hkv)  # GQA: consecutive query heads share a key/value head
            for i in range(Tq):
                js = [j for j in range(Tk) if visible(b, h, i, j)]
                if not js:
                    continue
                s = torch.stack([(q[b, h, i] * k[b, hk, j]).sum() * scale for j in js])
                if bias is not None:
                    s = s + torch.stack([bias[..., i, j].expand(B, H)[b, h].double() for j in js])
                p = torch.softmax(s, 0)
                out[b, h, i] = sum(p[n] * v[b, hk, j] for n, j in enumerate(js))
    return out


def pad_mask(B, Tk, lengths):
    keep = torch.zeros(B, Tk, dtype=torch.bool)
    for b, n in enumerate(lengths):
        keep[b, :n] = True
    return keep


CASES = ["none", "causal", "padding", "causal+padding", "bias", "bias+causal+padding", "gqa", "gqa+causal",
         "mqa"]


def make_case(case):
    B, H, Tq, D = 2, 4, 6, 8
    Hkv = {"gqa": 2, "gqa+causal": 2, "mqa": 1}.get(case, H)
    q, k, v = qkv_tensors(B, H, Hkv, Tq, Tq, D)
    causal = "causal" in case
    keep = pad_mask(B, Tq, [6, 4]) if "padding" in case else None
    bias = torch.randn(1, H, Tq, Tq) if "bias" in case else None
    mask = None if keep is None else keep[:, None, None, :]

    def visible(b, h, i, j):
        return (not causal or j <= i) and (keep is None or bool(keep[b, j]))

    return q, k, v, dict(mask=mask, bias=bias, causal=causal), visible


@pytest.mark.parametrize("case", CASES)
def test_backends_agree_with_each_other_and_with_a_loop(case):
    q, k, v, kw, visible = make_case(case)
    ref = loop_reference(q, k, v, visible=visible, bias=kw["bias"]).float()
    naive, _ = scaled_dot_product_attention(q, k, v, backend="naive", **kw)
    fused, _ = scaled_dot_product_attention(q, k, v, backend="fused", **kw)
    torch.testing.assert_close(naive, fused, atol=1e-5, rtol=0)
    torch.testing.assert_close(naive, ref, atol=1e-5, rtol=0)


def test_gqa_equals_torch_sdpa_with_repeated_heads():
    q, k, v = qkv_tensors(B=2, H=6, Hkv=2, Tq=5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), is_causal=True)
    for backend in BACKENDS:
        out, _ = scaled_dot_product_attention(q, k, v, causal=True, backend=backend)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["gqa", "gqa+causal", "mqa", "gqa+causal+padding"])
def test_fused_gqa_on_cpu_equals_sdpa_over_repeated_heads_and_its_gradients(case):
    """On CPU the fused backend lets PyTorch's kernel read the shared key/value heads (enable_gqa) instead of
    repeating them: the same output bit for bit, gradients to fp32 summation order."""
    B, H, T = 2, 6, 7
    Hkv = 1 if case == "mqa" else 2
    q, k, v = (t.requires_grad_() for t in qkv_tensors(B, H, Hkv, T, T, 8))
    keep = pad_mask(B, T, [7, 5]) if "padding" in case else None
    mask = None if keep is None else keep[:, None, None, :]
    causal = "causal" in case
    out, _ = scaled_dot_product_attention(q, k, v, mask=mask, causal=causal, backend="fused")
    full = mask & torch.ones(T, T, dtype=torch.bool).tril() if causal and mask is not None else mask
    r = H // Hkv
    ref = torch.nn.functional.scaled_dot_product_attention(  # causal without padding: the kernel's own mask
        q, k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1), attn_mask=full,
        is_causal=causal and mask is None)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Tq", [1, 3, 7])
def test_query_shorter_than_keys_is_causal_bottom_right(backend, Tq):
    # The queries are the newest Tq of Tk = 7 tokens (KV-cache decoding): query i sits at absolute
    # position i + (Tk - Tq) and must see every key up to and including that position.
    Tk = 7
    q, k, v = qkv_tensors(Tq=Tq, Tk=Tk)
    out, _ = scaled_dot_product_attention(q, k, v, causal=True, backend=backend)
    ref = loop_reference(q, k, v, visible=lambda b, h, i, j: j <= i + Tk - Tq).float()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # the same queries as the tail of a full causal pass give the same outputs
    qfull = torch.cat([torch.randn(2, 4, Tk - Tq, 8), q], dim=2)
    full, _ = scaled_dot_product_attention(qfull, k, v, causal=True, backend=backend)
    torch.testing.assert_close(out, full[:, :, Tk - Tq:], atol=1e-5, rtol=0)


def test_causal_mask_formula():
    m = causal_mask(2, 4)
    expected = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, expected)
    with pytest.raises(ValueError, match="at least as many keys"):
        causal_mask(4, 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fully_masked_row_gives_zeros_and_finite_gradients(backend, with_bias):
    q, k, v = qkv_tensors(Tq=4, grad=True)
    keep = pad_mask(2, 4, [4, 0])  # the second sequence has no real key at all
    bias = torch.randn(1, 4, 4, 4) if with_bias else None
    out, w = scaled_dot_product_attention(q, k, v, mask=keep[:, None, None, :], bias=bias, backend=backend,
                                          return_weights=backend == "naive")
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    if w is not None:
        assert torch.isfinite(w).all() and torch.equal(w[1], torch.zeros_like(w[1]))
    out.pow(2).sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_query_row_under_causal_padding(backend):
    # left padding + causal: the padded queries at the front see no real key at all
    q, k, v = qkv_tensors(Tq=5)
    keep = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    out, _ = scaled_dot_product_attention(q, k, v, mask=keep[:, None, None, :], causal=True, backend=backend)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, :, :2], torch.zeros_like(out[0, :, :2]))
    ref = loop_reference(q, k, v, visible=lambda b, h, i, j: j <= i and bool(keep[b, j])).float()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_weights_are_the_softmax_probabilities():
    q, k, v = qkv_tensors(Tq=5)
    keep = pad_mask(2, 5, [5, 3])
    out, w = scaled_dot_product_attention(q, k, v, mask=keep[:, None, None, :], causal=True, backend="naive",
                                          return_weights=True)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    allowed = keep[:, None, None, :] & torch.ones(5, 5, dtype=torch.bool).tril()
    ref = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    torch.testing.assert_close(w, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(out, w @ v, atol=1e-6, rtol=0)
    # the fused backend falls back to naive when weights are requested
    out2, w2 = scaled_dot_product_attention(q, k, v, mask=keep[:, None, None, :], causal=True,
                                            backend="fused", return_weights=True)
    torch.testing.assert_close(w2, w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_options(backend):
    q, k, v = qkv_tensors(Tq=4)
    unscaled = loop_reference(q, k, v, visible=lambda *a: True, scale=1.0).float()
    custom = loop_reference(q, k, v, visible=lambda *a: True, scale=0.3).float()
    out1, _ = scaled_dot_product_attention(q, k, v, scale=1.0, backend=backend)
    out2, _ = scaled_dot_product_attention(q, k, v, scale=0.3, backend=backend)
    torch.testing.assert_close(out1, unscaled, atol=1e-5, rtol=0)
    torch.testing.assert_close(out2, custom, atol=1e-5, rtol=0)
    assert not torch.allclose(out1, out2, atol=1e-3)

    # MultiHeadAttention(scaled=False) is scale 1.0, scaled=True is 1/sqrt(head_dim)
    x = torch.randn(2, 4, 16)
    plain = MultiHeadAttention(16, 2, backend=backend, scaled=False).eval()
    assert plain.scale == 1.0
    std = MultiHeadAttention(16, 2, backend=backend).eval()
    assert std.scale == pytest.approx(1 / math.sqrt(8))
    std.load_state_dict(plain.state_dict())
    a, _ = plain(x)
    qh, kh, vh = (t.view(2, 4, 2, 8).transpose(1, 2) for t in plain.qkv_proj(x).split(16, -1))
    ref = loop_reference(qh, kh, vh, visible=lambda *a: True, scale=1.0).float()
    torch.testing.assert_close(a, plain.out_proj(ref.transpose(1, 2).reshape(2, 4, 16)), atol=1e-5, rtol=0)
    assert not torch.allclose(a, std(x)[0], atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64(backend):
    q, k, v = qkv_tensors(B=1, H=2, Hkv=1, Tq=3, Tk=4, D=4, dtype=torch.float64, grad=True)
    keep = torch.tensor([[1, 1, 0, 1]], dtype=torch.bool)[:, None, None, :]
    bias = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, bias):
        return scaled_dot_product_attention(q, k, v, mask=keep, bias=bias, causal=True, backend=backend)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, bias))
    if backend == "naive":
        assert torch.autograd.gradgradcheck(f, (q, k, v, bias))


def test_unknown_backend_and_bad_heads_are_clear_errors():
    q, k, v = qkv_tensors(H=4, Hkv=3)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        scaled_dot_product_attention(q, k, v)
    q, k, v = qkv_tensors()
    with pytest.raises(ValueError, match="unknown attention backend"):
        scaled_dot_product_attention(q, k, v, backend="flash9")
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        MultiHeadAttention(16, 4, n_kv_heads=3)


# --------------------------------------------------------------------------------------------------
# MultiHeadAttention vs torch.nn.MultiheadAttention (batch_first) with the same weights


def torch_mha_from(ours: MultiHeadAttention) -> torch.nn.MultiheadAttention:
    d = ours.d_model
    ref = torch.nn.MultiheadAttention(d, ours.n_heads, batch_first=True).eval()
    with torch.no_grad():
        if ours.cross:
            w = torch.cat([ours.q_proj.weight, ours.kv_proj.weight])
            b = torch.cat([ours.q_proj.bias, ours.kv_proj.bias])
        else:
            w, b = ours.qkv_proj.weight, ours.qkv_proj.bias
        ref.in_proj_weight.copy_(w)  # both lay out [W_q; W_k; W_v]
        ref.in_proj_bias.copy_(b)
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    return ref


def randomize(m: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


@pytest.mark.parametrize("backend", BACKENDS)
def test_self_attention_equals_torch_mha(backend):
    B, T, d, H = 2, 6, 16, 4
    ours = randomize(MultiHeadAttention(d, H, backend=backend)).eval()
    ref = torch_mha_from(ours)
    x = torch.randn(B, T, d)
    keep = pad_mask(B, T, [6, 3])

    y, w = ours(x, mask=keep[:, None, None, :], return_weights=True)
    y_ref, w_ref = ref(x, x, x, key_padding_mask=~keep, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=0)

    y_plain, _ = ours(x, mask=keep[:, None, None, :])  # without weights (fused kernel path)
    torch.testing.assert_close(y_plain, y_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("padding", [False, True])
def test_causal_self_attention_equals_torch_mha(backend, padding):
    B, T, d, H = 2, 6, 16, 4
    ours = randomize(MultiHeadAttention(d, H, backend=backend, causal=True)).eval()
    ref = torch_mha_from(ours)
    x = torch.randn(B, T, d)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)  # torch: True = not allowed
    keep = pad_mask(B, T, [6, 4]) if padding else None
    y, w = ours(x, mask=None if keep is None else keep[:, None, None, :], return_weights=True)
    y_ref, w_ref = ref(x, x, x, attn_mask=future, key_padding_mask=None if keep is None else ~keep,
                       need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=0)
    y2, _ = ours(x, mask=None if keep is None else keep[:, None, None, :])
    torch.testing.assert_close(y2, y_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_attention_equals_torch_mha(backend):
    B, T, S, d, H = 2, 4, 7, 16, 2
    ours = randomize(MultiHeadAttention(d, H, backend=backend, cross=True)).eval()
    assert not ours.causal  # cross-attention never masks the memory causally
    ref = torch_mha_from(ours)
    x, memory = torch.randn(B, T, d), torch.randn(B, S, d)
    keep = pad_mask(B, S, [7, 2])
    y, w = ours(x, memory=memory, mask=keep[:, None, None, :], return_weights=True)
    y_ref, w_ref = ref(x, memory, memory, key_padding_mask=~keep, need_weights=True,
                       average_attn_weights=False)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="encoder memory"):
        ours(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_equals_full_attention_with_repeated_kv_weights(backend):
    # GQA with 2 kv heads for 4 query heads is exactly MHA whose k/v projections repeat each kv head
    # for its group of query heads.
    d, H, Hkv, hd = 16, 4, 2, 4
    gqa = randomize(MultiHeadAttention(d, H, n_kv_heads=Hkv, backend=backend, causal=True)).eval()
    full = MultiHeadAttention(d, H, backend=backend, causal=True).eval()
    wq, wk, wv = gqa.qkv_proj.weight.split([d, Hkv * hd, Hkv * hd])
    bq, bk, bv = gqa.qkv_proj.bias.split([d, Hkv * hd, Hkv * hd])

    def rep(t):  # (Hkv*hd, ...) -> (H*hd, ...): head g serves query heads 2g, 2g+1
        return t.reshape(Hkv, hd, *t.shape[1:]).repeat_interleave(H // Hkv, 0).reshape(H * hd, *t.shape[1:])

    with torch.no_grad():
        full.qkv_proj.weight.copy_(torch.cat([wq, rep(wk), rep(wv)]))
        full.qkv_proj.bias.copy_(torch.cat([bq, rep(bk), rep(bv)]))
        full.out_proj.load_state_dict(gqa.out_proj.state_dict())
    x = torch.randn(2, 5, d)
    torch.testing.assert_close(gqa(x)[0], full(x)[0], atol=1e-5, rtol=0)
    assert gqa.qkv_proj.weight.shape[0] == d + 2 * Hkv * hd  # fewer parameters than full MHA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_kernels_agree_and_fully_masked_rows_stay_finite(dtype):
    # the GPU flash / memory-efficient kernels are where fully masked rows turn into NaN (PyTorch #118628)
    q, k, v = (t.to("cuda", dtype).requires_grad_() for t in qkv_tensors(B=2, H=4, Tq=16, D=64))
    keep = pad_mask(2, 16, [16, 0]).cuda()[:, None, None, :]
    ref, _ = scaled_dot_product_attention(q.float(), k.float(), v.float(), mask=keep, causal=True,
                                          backend="naive")
    out, _ = scaled_dot_product_attention(q, k, v, mask=keep, causal=True, backend="fused")
    assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)
    out.float().pow(2).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    causal_only, _ = scaled_dot_product_attention(q, k, v, causal=True, backend="fused")  # is_causal kernel
    ref2, _ = scaled_dot_product_attention(q.float(), k.float(), v.float(), causal=True, backend="naive")
    torch.testing.assert_close(causal_only.float(), ref2, atol=2e-2, rtol=0)


