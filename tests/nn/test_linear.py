"""qkv.nn.linear: the oneDNN fp32 CPU path computes the same function and gradients as F.linear, is taken
only where intended (fp32 CPU, enough rows, no autocast) and only under the backend the public switch
(`qkv.nn.set_linear_backend` / `linear_backend`) selects."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.nn import linear as L

needs_onednn = pytest.mark.skipif(not L._probe(), reason="this torch build has no oneDNN fp32 linear")


@pytest.fixture
def onednn():
    with qkv.nn.linear_backend("onednn"):
        yield


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape,out", [((4, 50, 48), 72), ((130, 48), 72), ((2, 3, 40, 24), 8), ((1, 64, 33), 65)])
def test_forward_and_grads_equal_f_linear(onednn, shape, out, bias):
    x = torch.randn(*shape, requires_grad=True)
    w = torch.randn(out, shape[-1], requires_grad=True)
    b = torch.randn(out, requires_grad=True) if bias else None
    assert L.use_onednn(x, w)
    g = torch.randn(*shape[:-1], out)
    ref = F.linear(x, w, b)
    ref_grads = torch.autograd.grad(ref, [x, w] + ([b] if bias else []), g)
    got = L.linear(x, w, b)
    grads = torch.autograd.grad(got, [x, w] + ([b] if bias else []), g)
    assert got.grad_fn is not None and "OneDNN" in type(got.grad_fn).__name__
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
    for have, want in zip(grads, ref_grads):
        torch.testing.assert_close(have, want, atol=1e-3, rtol=1e-5)


@needs_onednn
def test_only_input_grad_or_only_weight_grad(onednn):
    x = torch.randn(80, 16, requires_grad=True)
    w = torch.randn(8, 16)
    (gx,) = torch.autograd.grad(L.linear(x, w).sum(), [x])
    torch.testing.assert_close(gx, w.sum(0).expand(80, 16), atol=1e-5, rtol=1e-5)
    x2, w2 = torch.randn(80, 16), torch.randn(8, 16, requires_grad=True)
    (gw,) = torch.autograd.grad(L.linear(x2, w2).sum(), [w2])
    torch.testing.assert_close(gw, x2.sum(0).expand(8, 16), atol=1e-4, rtol=1e-5)


@needs_onednn
def test_a_model_trains_the_same_under_both_backends():
    """A small GPT: the loss and every gradient agree between the oneDNN and the aten backend."""
    results = []
    for backend in ("onednn", "aten"):
        torch.manual_seed(0)
        model = qkv.build("gpt-bench", n_layers=2, d_model=64, n_heads=4, context_length=32, dropout=0.0)
        x = torch.randint(0, 65, (4, 32))
        with qkv.nn.linear_backend(backend):
            assert L.use_onednn(torch.randn(128, 64), torch.randn(8, 64)) == (backend == "onednn")
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l1, g1), (l2, g2) = results
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], atol=1e-5, rtol=1e-4, msg=name)


def test_fast_path_only_where_intended(onednn):
    w = torch.randn(8, 16)
    assert not L.use_onednn(torch.randn(3, 16), w)  # a decoding step: few rows, MKL is faster
    assert not L.use_onednn(torch.randn(100, 16, dtype=torch.float64), w.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not L.use_onednn(torch.randn(100, 16), w)
        layer = L.Linear(16, 8)
        assert layer(torch.randn(100, 16)).dtype == torch.bfloat16  # autocast still applies


def test_backend_switch(monkeypatch):
    w, x = torch.randn(8, 16), torch.randn(100, 16)
    before = qkv.nn.get_linear_backend()
    with qkv.nn.linear_backend("aten"):
        assert qkv.nn.get_linear_backend() == "aten" and not L.use_onednn(x, w)
    assert qkv.nn.get_linear_backend() == before
    with pytest.raises(RuntimeError), qkv.nn.linear_backend("aten"):  # restored after an exception too
        raise RuntimeError
    assert qkv.nn.get_linear_backend() == before
    with pytest.raises(ValueError, match="not one of"):
        qkv.nn.set_linear_backend("mkl")
    assert qkv.nn.get_linear_backend() == before
    # "auto": oneDNN only on AVX-512 CPUs (where it was measured to pay), aten elsewhere
    monkeypatch.setattr(L, "_AVAILABLE", True)
    with qkv.nn.linear_backend("auto"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
        assert not L.use_onednn(x, w)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
        assert L.use_onednn(x, w)
    monkeypatch.setattr(L, "_AVAILABLE", False)  # a build without the op: "onednn" is refused, "auto" is aten
    with pytest.raises(ValueError, match="no oneDNN"):
        qkv.nn.set_linear_backend("onednn")
    with qkv.nn.linear_backend("auto"):
        assert not L.use_onednn(x, w)


@pytest.mark.parametrize("env,want", [({}, "auto"), ({"QKV_ONEDNN": "0"}, "aten"),
                                      ({"QKV_LINEAR_BACKEND": "onednn"}, "onednn"),
                                      ({"QKV_LINEAR_BACKEND": "ATEN", "QKV_ONEDNN": "1"}, "aten")])
def test_backend_from_the_environment(monkeypatch, env, want):
    monkeypatch.delenv("QKV_ONEDNN", raising=False)
    monkeypatch.delenv("QKV_LINEAR_BACKEND", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert L._backend_from_env() == want


def test_linear_module_is_a_drop_in_nn_linear():
    layer = L.Linear(16, 8)
    assert isinstance(layer, torch.nn.Linear)
    assert list(layer.state_dict()) == ["weight", "bias"]
    x = torch.randn(2, 70, 16)
    for backend in ("auto", "aten") + (("onednn",) if L._probe() else ()):
        with qkv.nn.linear_backend(backend):
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_probe_does_not_touch_the_global_rng(monkeypatch):
    """The first call probes oneDNN; that must not shift torch's RNG (bit-exact resume depends on it)."""
    monkeypatch.setattr(L, "_AVAILABLE", None)
    torch.manual_seed(7)
    L.onednn_available()
    got = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(got, torch.rand(3))


@pytest.mark.parametrize("path", ["narrow-direct", "transposed", "packed"])
@pytest.mark.parametrize("in_f, out_f", [(48, 16), (16, 48), (24, 24)])
@pytest.mark.parametrize("bias", [True, False])
def test_step_equals_f_linear_in_every_layout(monkeypatch, path, in_f, out_f, bias):
    """The decoding path (narrowing products through the (out, in) weight, the others through the transposed copy;
    or every product through the copy; or, for several rows, oneDNN's packed copy) computes F.linear, with and
    without the folded query scale."""
    if path == "packed" and not L.onednn_packable():
        pytest.skip("this torch build cannot pack weights for oneDNN")
    monkeypatch.setattr(L, "STEP_NARROW_DIRECT", path == "narrow-direct")
    monkeypatch.setattr(L, "STEP_PACKED_MIN_ROWS", 2 if path == "packed" else 0)
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


@pytest.mark.skipif(not L.onednn_packable(), reason="this torch build cannot pack weights for oneDNN")
def test_batched_step_copy_is_rebuilt_dropped_and_never_copied(monkeypatch):
    """The packed copy of a batched step: built once, rebuilt after an in-place weight change, dropped by
    free_packed, and left behind by deepcopy and pickling (an opaque oneDNN tensor; rebuilt at the next step)."""
    import copy
    import io

    monkeypatch.setattr(L, "STEP_PACKED_MIN_ROWS", 2)
    torch.manual_seed(0)
    lin = L.Linear(24, 40)
    x = torch.randn(8, 24)
    with torch.no_grad():
        torch.testing.assert_close(lin.step(x), F.linear(x, lin.weight, lin.bias), rtol=1e-6, atol=1e-6)
        first = lin.__dict__["_decode_onednn"]["copy"]
        lin.step(x)
        assert lin.__dict__["_decode_onednn"]["copy"] is first
        lin.weight.mul_(-2.0)
        torch.testing.assert_close(lin.step(x), F.linear(x, lin.weight, lin.bias), rtol=1e-6, atol=1e-6)
        assert lin.__dict__["_decode_onednn"]["copy"] is not first
        twin = copy.deepcopy(lin)
        torch.save(lin, io.BytesIO())
        assert "copy" not in twin.__dict__["_decode_onednn"]
        torch.testing.assert_close(twin.step(x), F.linear(x, lin.weight, lin.bias), rtol=1e-6, atol=1e-6)
        assert L.free_packed(lin) == 1 and "_decode_onednn" not in lin.__dict__
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast keeps the aten path (its bf16 product)
            lin.step(x)
        assert "_decode_onednn" not in lin.__dict__


# -- bf16 products of several rows on a CPU without native bf16: fp32 tiles of the weight ------------------------
@pytest.fixture
def no_native_bf16(monkeypatch):
    """The tiled bf16 route applies only where the CPU lacks native bf16: forced here, so every machine tests it."""
    monkeypatch.setattr(L, "_NATIVE_BF16", False)


def _bf16_bound(x: torch.Tensor, w: torch.Tensor, ref64: torch.Tensor) -> torch.Tensor:
    """One bf16 rounding of the exact result (half an ulp: 2^-8 relative) plus fp32 summation error."""
    return ref64.abs() * 2.0 ** -8 + 1e-5 * (x.double().abs() @ w.double().abs().t())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape,out,tile", [((4, 48), 72, 1 << 18), ((8, 48), 72, 48 * 5), ((2, 3, 40), 33, 7 * 40),
                                            ((32, 24), 1000, 24 * 64), ((5, 7), 3, 1)])
def test_bf16_tiles_equal_f_linear_and_the_float64_product(monkeypatch, no_native_bf16, shape, out, tile, bias):
    monkeypatch.setattr(L, "BF16_TILE_ELEMS", tile)  # several tiles, a ragged last one, one row per tile
    monkeypatch.setattr(L, "BF16_TILE_MIN_ROWS", 4)  # the route itself, for shapes of 4 rows and more
    x = torch.randn(*shape).bfloat16()
    w = (torch.randn(out, shape[-1]) * shape[-1] ** -0.5).bfloat16()
    b = torch.randn(out).bfloat16() if bias else None
    with torch.no_grad():
        assert L.use_bf16_tiles(x, w)
        got = L.linear(x, w, b)
        want = F.linear(x, w, b)
    ref64 = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    x2, r2 = x.reshape(-1, shape[-1]), ref64.reshape(-1, out)
    assert ((got.double().reshape(-1, out) - r2).abs() <= _bf16_bound(x2, w, r2)).all()
    # the same products and fp32 sums as F.linear's bf16 kernel: equal but for a rare 1-ulp rounding flip
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2.0 ** -7 + 1e-30).all() and (diff > 0).float().mean() < 0.01


def test_bf16_tiles_are_taken_only_where_meant(no_native_bf16, monkeypatch):
    w = torch.randn(8, 16).bfloat16()
    with torch.no_grad():
        n = L.BF16_TILE_MIN_ROWS
        assert L.use_bf16_tiles(torch.randn(n, 16).bfloat16(), w)
        assert not L.use_bf16_tiles(torch.randn(n - 1, 16).bfloat16(), w)  # a small batch's step: F.linear's kernel
        assert not L.use_bf16_tiles(torch.randn(1, 16).bfloat16(), w)  # one row (a batch-1 step)
        assert not L.use_bf16_tiles(torch.randn(4, 16), w.float())  # fp32 untouched
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not L.use_bf16_tiles(torch.randn(4, 16).bfloat16(), w)
        monkeypatch.setattr(L, "BF16_TILE_MIN_ROWS", 0)
        assert not L.use_bf16_tiles(torch.randn(4, 16).bfloat16(), w)  # the switch off
        monkeypatch.setattr(L, "BF16_TILE_MIN_ROWS", 4)
        monkeypatch.setattr(L, "_NATIVE_BF16", True)
        assert not L.use_bf16_tiles(torch.randn(4, 16).bfloat16(), w)  # native bf16: oneDNN's kernels
    monkeypatch.setattr(L, "_NATIVE_BF16", False)
    assert not L.use_bf16_tiles(torch.randn(4, 16).bfloat16(), w)  # autograd (training): F.linear, with its backward
    layer = L.Linear(16, 8).bfloat16()
    x = torch.randn(6, 16, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


@pytest.mark.parametrize("rows", [1, 8, 32, 40])
def test_bf16_step_takes_the_tiles_and_equals_f_linear(no_native_bf16, monkeypatch, rows):
    calls = []
    real = L.bf16_tiled_linear
    monkeypatch.setattr(L, "bf16_tiled_linear", lambda *a: calls.append(1) or real(*a))
    lin = L.Linear(40, 24).bfloat16()
    x = torch.randn(rows, 40).bfloat16()
    with torch.no_grad():
        got, scaled = lin.step(x), lin.step(x, (10, 0.5))
        want = F.linear(x, lin.weight, lin.bias)
    assert len(calls) == (2 if rows >= L.BF16_TILE_MIN_ROWS else 0)
    assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2.0 ** -7
    torch.testing.assert_close(scaled[:, :10], got[:, :10] * 0.5, rtol=0, atol=0)
    torch.testing.assert_close(scaled[:, 10:], got[:, 10:], rtol=0, atol=0)


# -- bf16 decoding steps of few rows on a CPU without native bf16: an fp16 copy for fbgemm's fp16 GEMM ------------
needs_fp16 = pytest.mark.skipif(not L.fp16_packable(), reason="this torch build has no fbgemm fp16 GEMM")


@needs_fp16
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape,out", [((1, 48), 72), ((3, 40), 33), ((2, 1, 64), 130), ((1, 576), 1000)])
def test_bf16_fp16_step_equals_f_linear_and_the_float64_product(no_native_bf16, monkeypatch, shape, out, bias):
    """Linear.step's fp16 route against F.linear's bf16 kernel and the float64 product, with weights over a wide range
    (tiny ones that fp16 holds only after the power-of-two scaling, one row of zeros, large ones) and scale_first."""
    monkeypatch.setattr(L, "STEP_FP16_MIN_WEIGHT", 0)  # small layers here
    monkeypatch.setattr(L, "STEP_FP16_MIN_ROWS", 1)  # one row too (by default one row keeps torch's kernel)
    layer = L.Linear(shape[-1], out, bias=bias).bfloat16()
    with torch.no_grad():
        # |w| from 1e-7 to 100 (a span of 2^30: inside what fp16 holds exactly after the power-of-two scaling)
        w = torch.randn(out, shape[-1]).sign() * 10 ** (torch.rand(out, shape[-1]) * 9 - 7)
        w[1] = 0
        layer.weight.copy_(w)
    x = torch.randn(*shape).bfloat16()
    with torch.no_grad():
        assert L.use_fp16_step(x, layer.weight)
        got = layer.step(x)
        scaled = layer.step(x, (5, 0.125))
        want = F.linear(x, layer.weight, layer.bias)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert layer.__dict__["_decode_fp16"]["copy"][1] is not None  # the fp16 copy was made and used
    b = None if layer.bias is None else layer.bias.double()
    ref64 = F.linear(x.double(), layer.weight.double(), b).reshape(-1, out)
    x2 = x.reshape(-1, shape[-1])
    assert ((got.double().reshape(-1, out) - ref64).abs() <= _bf16_bound(x2, layer.weight, ref64)).all()
    # the same (exact) products and fp32 sums as F.linear's bf16 kernel: within one ulp of the output plus what the
    # order of an fp32 sum can change (where the terms cancel), and equal but for rare rounding flips
    ulp = 2.0 ** (want.float().abs().clamp_min(2.0 ** -126).log2().floor() - 7)
    order = 2.0 ** -24 * shape[-1] * (x2.double().abs() @ layer.weight.double().abs().t()).reshape(want.shape)
    diff = (got.float() - want.float()).abs()
    assert (diff <= ulp + order.float()).all() and (diff > 0).float().mean() < 0.01
    torch.testing.assert_close(scaled[..., :5], (got[..., :5] * 0.125), atol=0, rtol=0)
    assert torch.equal(scaled[..., 5:], got[..., 5:])


@needs_fp16
def test_bf16_fp16_step_copy_is_rebuilt_dropped_and_taken_only_where_meant(no_native_bf16, monkeypatch):
    import copy
    import pickle

    monkeypatch.setattr(L, "STEP_FP16_MIN_WEIGHT", 0)
    layer = L.Linear(16, 8).bfloat16()
    x = torch.randn(2, 16).bfloat16()
    with torch.no_grad():
        first = layer.step(x)
        layer.weight.mul_(2)  # an in-place change: the copy is rebuilt
        torch.testing.assert_close(layer.step(x), F.linear(x, layer.weight, layer.bias), atol=0.05, rtol=0.02)
        assert not torch.equal(layer.step(x), first)
    assert "_decode_fp16" in layer.__dict__
    assert copy.deepcopy(layer).__dict__["_decode_fp16"] == {}  # an opaque packed copy: never copied or pickled
    assert pickle.loads(pickle.dumps(layer)).__dict__["_decode_fp16"] == {}
    assert L.free_packed(layer) == 1 and "_decode_fp16" not in layer.__dict__
    w = layer.weight
    with torch.no_grad():
        assert L.use_fp16_step(torch.randn(3, 16).bfloat16(), w)
        assert not L.use_fp16_step(torch.randn(1, 16).bfloat16(), w)  # one row: torch's bf16 kernel ...
        monkeypatch.setattr(L, "STEP_FP16_ONE_ROW_MIN_WEIGHT", w.numel())
        assert L.use_fp16_step(torch.randn(1, 16).bfloat16(), w)  # ... but for a large weight (an output head)
        monkeypatch.setattr(L, "STEP_FP16_ONE_ROW_MIN_WEIGHT", 0)
        assert not L.use_fp16_step(torch.randn(1, 16).bfloat16(), w)  # 0: never at one row
        assert not L.use_fp16_step(torch.randn(1, 16), w.float())  # fp32 untouched
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not L.use_fp16_step(x, w)
        monkeypatch.setattr(L, "STEP_BF16_VIA_FP16", False)
        assert not L.use_fp16_step(x, w)  # the switch off
        monkeypatch.setattr(L, "STEP_BF16_VIA_FP16", True)
        monkeypatch.setattr(L, "STEP_FP16_MIN_WEIGHT", w.numel() + 1)
        assert not L.use_fp16_step(x, w)  # a small layer: F.linear
        monkeypatch.setattr(L, "STEP_FP16_MIN_WEIGHT", 0)
        monkeypatch.setattr(L, "_NATIVE_BF16", True)
        assert not L.use_fp16_step(x, w)  # native bf16: oneDNN's kernels
    monkeypatch.setattr(L, "_NATIVE_BF16", False)
    assert not L.use_fp16_step(x, w)  # autograd: F.linear


# -- bf16 autocast (training) on a CPU without native bf16: the fp32 BLAS on bf16-rounded operands --------------
def _r(t: torch.Tensor) -> torch.Tensor:
    """What autocast multiplies: the value rounded to bf16 (exact in float64)."""
    return t.detach().bfloat16().double()


def _assert_bf16_of(got: torch.Tensor, exact: torch.Tensor, abs_terms: torch.Tensor) -> None:
    """got is `exact` (a float64 sum of products) rounded to bf16 after an fp32 summation: within half a bf16 ulp of
    it plus the fp32 summation error (bounded by 1e-5 of the sum of |terms|); and equal to exact's own bf16
    rounding but for rare 1-ulp flips."""
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-5 * abs_terms).all()
    assert ((got.double() - exact.bfloat16().double()) != 0).double().mean() < 0.02


def _autocast_linear(x, w, b, g):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = L.linear(x, w, b)
    return y, torch.autograd.grad(y, [x, w] + ([b] if b is not None else []), g)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape,out,x_dtype", [((4, 20, 48), 72, torch.float32), ((130, 48), 40, torch.float32),
                                               ((64, 33), 65, torch.bfloat16)])
def test_bf16_autocast_route_equals_the_bf16_computation_and_autocast(no_native_bf16, monkeypatch, shape, out,
                                                                      x_dtype, bias):
    torch.manual_seed(0)
    x = torch.randn(*shape).to(x_dtype).requires_grad_()
    w = (torch.randn(out, shape[-1]) * shape[-1] ** -0.5).requires_grad_()
    b = torch.randn(out, requires_grad=True) if bias else None
    g = torch.randn(*shape[:-1], out).bfloat16()  # autocast's output is bf16, so is its gradient
    y, grads = _autocast_linear(x, w, b, g)
    assert type(y.grad_fn).__name__ == "_Bf16AutocastLinearBackward" and y.dtype == torch.bfloat16
    assert [t.dtype for t in grads] == [x_dtype, torch.float32] + ([torch.float32] if bias else [])
    # the reference, written out: bf16-rounded operands, an exact sum, one bf16 rounding of each result
    x2, g2 = _r(x).reshape(-1, shape[-1]), g.double().reshape(-1, out)
    wr = _r(w)
    _assert_bf16_of(y.reshape(-1, out), x2 @ wr.t() + (_r(b) if bias else 0), x2.abs() @ wr.abs().t())
    _assert_bf16_of(grads[0].reshape(-1, shape[-1]), g2 @ wr, g2.abs() @ wr.abs())
    _assert_bf16_of(grads[1], g2.t() @ x2, g2.abs().t() @ x2.abs())
    if bias:
        _assert_bf16_of(grads[2], g2.sum(0), g2.abs().sum(0))
    # and autocast's own bf16 kernels (the route off): the same values within bf16 rounding
    monkeypatch.setattr(L, "BF16_AUTOCAST_FP32", False)
    y_n, grads_n = _autocast_linear(x, w, b, g)
    assert "Bf16" not in type(y_n.grad_fn).__name__ and y_n.dtype == torch.bfloat16
    for have, want in zip((y, *grads), (y_n, *grads_n)):
        assert have.dtype == want.dtype
        torch.testing.assert_close(have.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_bf16_autocast_route_gives_only_the_gradients_asked_for(no_native_bf16):
    x, w = torch.randn(40, 16, requires_grad=True), torch.randn(8, 16)
    g = torch.ones(40, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (gx,) = torch.autograd.grad(L.linear(x, w), [x], g)
    torch.testing.assert_close(gx.double(), _r(w).sum(0).bfloat16().double().expand(40, 16), rtol=0, atol=0)
    x2, w2 = torch.randn(40, 16), torch.randn(8, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (gw,) = torch.autograd.grad(L.linear(x2, w2), [w2], g)
    _assert_bf16_of(gw, _r(x2).sum(0).expand(8, 16), _r(x2).abs().sum(0).expand(8, 16))


class _Sub(torch.Tensor):
    """A tensor subclass (as DTensor or a quantised weight): its own ops, never the route."""


def test_bf16_autocast_route_is_taken_only_where_meant(no_native_bf16, monkeypatch):
    w, b = torch.randn(8, 16, requires_grad=True), torch.randn(8, requires_grad=True)
    x = torch.randn(2, 20, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert L.use_bf16_autocast_fp32(x)
        assert not L.use_bf16_autocast_fp32(torch.randn(L.BF16_TILE_MIN_ROWS - 1, 16))  # few rows: autocast's kernel
        assert L.use_bf16_autocast_fp32(x, w) and not L.use_bf16_autocast_fp32(x, w.detach().as_subclass(_Sub))
        with torch.no_grad():  # an evaluation under autocast takes it too
            assert L.use_bf16_autocast_fp32(x)
    with torch.autocast("cpu", dtype=torch.float16):
        assert not L.use_bf16_autocast_fp32(x)
    assert not L.use_bf16_autocast_fp32(x)  # no autocast
    # autocast off, fp32: F.linear untouched (bit for bit, with its own backward)
    with qkv.nn.linear_backend("aten"):
        y = L.linear(x, w, b)
    assert type(y.grad_fn).__name__ != "_Bf16AutocastLinearBackward" and y.dtype == torch.float32
    assert torch.equal(y, F.linear(x, w, b))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        monkeypatch.setattr(L, "BF16_AUTOCAST_FP32", False)
        assert not L.use_bf16_autocast_fp32(x)  # the switch off
        monkeypatch.setattr(L, "BF16_AUTOCAST_FP32", True)
        monkeypatch.setattr(L, "_NATIVE_BF16", True)
        assert not L.use_bf16_autocast_fp32(x)  # native bf16: oneDNN's kernels
        y = L.linear(x, w, b)
        assert y.dtype == torch.bfloat16 and type(y.grad_fn).__name__ != "_Bf16AutocastLinearBackward"


def test_a_tiny_bert_fine_tune_step_under_bf16_autocast_matches_autocast_kernels(no_native_bf16, monkeypatch):
    """One classification step of a small BERT (padding, unpadded rows, fused attention) under bf16 autocast: the
    route (every Linear of the layers and the attention) gives autocast's loss and gradients within bf16 tolerance."""
    from qkv.models.bert import BERT, BERTConfig
    from qkv.nn import attention as A

    torch.manual_seed(0)
    model = BERT(BERTConfig(vocab_size=50, n_layers=2, d_model=64, n_heads=4, context_length=32, head="classify",
                            num_labels=3, dropout=0.0)).train()
    ids = torch.randint(0, 50, (4, 24))
    mask = (torch.arange(24)[None] < torch.tensor([24, 20, 13, 17])[:, None]).long()
    labels = torch.tensor([0, 2, 1, 2])
    taken = []
    real = L.use_bf16_autocast_fp32
    monkeypatch.setattr(A, "use_bf16_autocast_fp32", lambda q: taken.append("attention") or real(q))
    monkeypatch.setattr(L, "use_bf16_autocast_fp32", lambda x, w: real(x, w) and not taken.append("linear"))
    results = []
    for on in (True, False):
        monkeypatch.setattr(L, "BF16_AUTOCAST_FP32", on)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.float().backward()
        results.append((float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert taken.count("linear") == 2 * 4 and "attention" in taken  # 4 linears per layer took the route, once
    (loss, grads), (loss_n, grads_n) = results
    assert grads.keys() == grads_n.keys()
    assert abs(loss - loss_n) <= 1e-2 * abs(loss_n)
    for name, gr in grads.items():
        rel = (gr - grads_n[name]).norm() / grads_n[name].norm().clamp_min(1e-12)
        assert rel < 5e-2, name


@needs_fp16
def test_bf16_fp16_step_keeps_f_linear_for_a_weight_fp16_cannot_hold(no_native_bf16, monkeypatch):
    """A weight spanning more than 2^32 (a row of 1e-12 beside weights of 1) is not exact in fp16 even after the
    scaling: no fp16 copy, and the step equals F.linear's bf16 product bit for bit (the tiny row included)."""
    monkeypatch.setattr(L, "STEP_FP16_MIN_WEIGHT", 0)
    monkeypatch.setattr(L, "STEP_FP16_MIN_ROWS", 1)
    layer = L.Linear(32, 8, bias=False).bfloat16()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(8, 32))
        layer.weight[3] = torch.randn(32) * 1e-12
    x = torch.randn(1, 32).bfloat16()
    with torch.no_grad():
        got, want = layer.step(x), F.linear(x, layer.weight, layer.bias)
    assert layer.__dict__["_decode_fp16"]["copy"][1] is None
    assert want[0, 3] != 0 and torch.equal(got, want)  # an fp16 copy would have rounded row 3 to zeros
