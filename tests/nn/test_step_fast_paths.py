"""The batch-1 decoding step's fast paths (step12c) against independent references: a gated FFN's gate and up as one
product (linear.joint_step), RoPE's query and key heads rotated in one pass (RoPE.rotate_heads), RMSNorm's mean
square as one BLAS product (RMSNorm.step), the attention products on one thread (attention.STEP_SERIAL_MAX); and
a whole fp32 step of a Llama-shaped model equal to the full forward and to the step with every fast path off.
(tests/nn/test_step_matrix.py runs in float64, where the fp32-only paths step aside.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv
import qkv.nn.attention as attention
import qkv.nn.linear as linear
import qkv.nn.norm as norm_module
from qkv.nn.ffn import FeedForward
from qkv.nn.norm import RMSNorm
from qkv.nn.position import RoPE


@pytest.fixture
def two_threads():
    """Two torch threads inside the test (the one-thread region has something to switch), restored after."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def _fast_paths(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """Every switch of the step's fast paths (as benchmarks/_step_switches.py) on or off."""
    monkeypatch.setattr(attention, "STEP_SERIAL_MAX", 1 << 18 if on else 0)
    monkeypatch.setattr(attention, "STEP_JOINT_ROTATE", on)
    monkeypatch.setattr(linear, "JOINT_STEP", on)
    monkeypatch.setattr(norm_module, "STEP_DOT_NORM", on)


def _ffn_reference(ffn: FeedForward, x: torch.Tensor) -> torch.Tensor:
    """W2 (silu(W3 x) * W1 x) written out in float64 from the parameters."""
    d = {k: (None if v is None else v.double()) for k, v in
         dict(gw=ffn.gate.weight, gb=ffn.gate.bias, uw=ffn.up.weight, ub=ffn.up.bias, dw=ffn.down.weight,
              db=ffn.down.bias).items()}
    x = x.double()
    h = F.silu(F.linear(x, d["gw"], d["gb"])) * F.linear(x, d["uw"], d["ub"])
    return F.linear(h, d["dw"], d["db"])


@pytest.mark.parametrize("bias", [False, True])
def test_joint_gate_up_step_equals_formula_and_follows_weight_changes(bias):
    torch.manual_seed(0)
    ffn = FeedForward(32, 48, "swiglu", bias=bias).eval()
    x = torch.randn(1, 32)
    with torch.no_grad():
        y = ffn.step(x)
        assert "_decode_joined" in ffn.__dict__  # the joint path was taken
        assert "_decode_copy" not in ffn.gate.__dict__ and "_decode_copy" not in ffn.up.__dict__
        torch.testing.assert_close(y.double(), _ffn_reference(ffn, x), rtol=1e-5, atol=1e-6)
        ffn.gate.weight.mul_(-2.0)  # an in-place change (optimizer step, load_state_dict): the copy is rebuilt
        if bias:
            ffn.up.bias.add_(1.0)
        torch.testing.assert_close(ffn.step(x).double(), _ffn_reference(ffn, x), rtol=1e-5, atol=1e-6)
    assert linear.free_packed(ffn) >= 1 and "_decode_joined" not in ffn.__dict__


def test_joint_step_steps_aside_where_it_does_not_apply():
    ffn = FeedForward(16, 24, "swiglu", bias=False).eval()
    with torch.no_grad():
        assert linear.joint_step(ffn, torch.randn(2, 16), (ffn.gate, ffn.up)) is None  # several rows
        assert linear.joint_step(ffn, torch.randn(1, 16).double(), (ffn.gate, ffn.up)) is None  # not fp32
    assert linear.joint_step(ffn, torch.randn(1, 16), (ffn.gate, ffn.up)) is None  # autograd on
    x = torch.randn(1, 16, requires_grad=True)
    ffn.step(x).sum().backward()  # the separate products, differentiable
    assert x.grad is not None


needs_fp16 = pytest.mark.skipif(not linear.fp16_packable(), reason="this torch build has no fbgemm fp16 GEMM")


def _bf16_products(x: torch.Tensor, linears: tuple) -> torch.Tensor:
    """torch's own bf16 products of x by each linear, side by side (what the joined copy replaces)."""
    return torch.cat([F.linear(x, lin.weight, lin.bias) for lin in linears], dim=-1)


def _within_ulp_and_order(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, linears: tuple) -> None:
    """got equals want (both bf16 products of x) but for the order of their fp32 sums: within one bf16 ulp of the
    output plus what reordering an fp32 sum of these terms can change, and equal almost everywhere."""
    w = torch.cat([lin.weight for lin in linears]).double()
    ulp = 2.0 ** (want.float().abs().clamp_min(2.0 ** -126).log2().floor() - 7)
    order = 2.0 ** -24 * x.shape[-1] * (x.double().abs() @ w.abs().t())
    diff = (got.float() - want.float()).abs()
    assert (diff <= ulp + order.float()).all() and (diff > 0).float().mean() < 0.02


@needs_fp16
@pytest.mark.parametrize("rows", [2, 5])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_joint_gate_up_step_through_one_fp16_copy(monkeypatch, rows, bias):
    """A bf16 gated FFN's gate and up at a batch's few rows: one product through one joined fbgemm fp16 copy (the layers' own
    fp16 copies never built), equal to torch's two bf16 products up to fp32 summation order, rebuilt after a weight
    changes in place, never copied or pickled, dropped by free_packed; the whole step equals the float64 formula to
    bf16 precision."""
    import copy
    import pickle

    monkeypatch.setattr(linear, "_NATIVE_BF16", False)  # the route is for CPUs without native bf16: forced here
    monkeypatch.setattr(linear, "STEP_FP16_MIN_WEIGHT", 0)  # a small FFN here
    torch.manual_seed(0)
    ffn = FeedForward(48, 40, "swiglu", bias=bias).bfloat16().eval()
    pair = (ffn.gate, ffn.up)
    x = torch.randn(rows, 48).bfloat16()
    with torch.no_grad():
        gu = linear.joint_step(ffn, x, pair)
        assert gu is not None and gu.dtype == torch.bfloat16 and gu.shape == (rows, 80)
        assert ffn.__dict__["_decode_joined_fp16"]["copy"][1] is not None
        _within_ulp_and_order(gu, _bf16_products(x, pair), x, pair)
        y = ffn.step(x)
        assert "_decode_fp16" not in ffn.gate.__dict__ and "_decode_fp16" not in ffn.up.__dict__
        ref = _ffn_reference(ffn, x)  # float64 from the bf16 parameters; bf16 rounds g, h, the product, the output
        torch.testing.assert_close(y.double(), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
        ffn.gate.weight.mul_(-2.0)  # an in-place change (optimizer step, load_state_dict): the copy is rebuilt
        if bias:
            ffn.up.bias.add_(1.0)
        _within_ulp_and_order(linear.joint_step(ffn, x, pair), _bf16_products(x, pair), x, pair)
    assert copy.deepcopy(ffn).__dict__["_decode_joined_fp16"] == {}  # an opaque packed copy
    assert pickle.loads(pickle.dumps(ffn)).__dict__["_decode_joined_fp16"] == {}
    assert linear.free_packed(ffn) >= 1 and "_decode_joined_fp16" not in ffn.__dict__


@needs_fp16
def test_bf16_joint_step_steps_aside_where_it_does_not_apply(monkeypatch):
    monkeypatch.setattr(linear, "_NATIVE_BF16", False)
    monkeypatch.setattr(linear, "STEP_FP16_MIN_WEIGHT", 0)
    ffn = FeedForward(16, 24, "swiglu", bias=False).bfloat16().eval()
    pair, x = (ffn.gate, ffn.up), torch.randn(2, 16).bfloat16()
    with torch.no_grad():
        assert linear.joint_step(ffn, x, pair) is not None
        assert linear.joint_step(ffn, x[:1], pair) is None  # one row: torch's bf16 kernel for each
        assert linear.joint_step(ffn, torch.randn(linear.BF16_TILE_MIN_ROWS, 16).bfloat16(), pair) is None  # tiles
        for name, off in (("JOINT_STEP_BF16", False), ("STEP_BF16_VIA_FP16", False), ("JOINT_STEP", False),
                          ("STEP_FP16_MIN_WEIGHT", 2 * 16 * 24 + 1), ("_NATIVE_BF16", True)):
            with monkeypatch.context() as m:
                m.setattr(linear, name, off)
                assert linear.joint_step(ffn, x, pair) is None, name
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert linear.joint_step(ffn, x, pair) is None
        ffn.gate.weight[0, 0] = 2.0 ** -40  # beside weights near 1: more than fp16 can hold exactly after scaling
        assert linear.joint_step(ffn, x, pair) is None  # each Linear.step then (F.linear for such a weight)
        ref = _ffn_reference(ffn, x)
        torch.testing.assert_close(ffn.step(x).double(), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
        assert "_decode_fp16" in ffn.up.__dict__  # up through its own fp16 copy; gate (the tiny weight) F.linear
        assert ffn.gate.__dict__["_decode_fp16"]["copy"][1] is None
    assert linear.joint_step(ffn, x, pair) is None  # autograd on


@pytest.mark.parametrize("offset", [0, 7, "rows"])
def test_rotate_heads_equals_rotate(offset):
    rope = RoPE(16, max_len=8)
    torch.manual_seed(1)
    B = 2 if offset == "rows" else 1
    q, k = torch.randn(B, 4, 1, 16), torch.randn(B, 2, 1, 16)
    off = torch.tensor([3, 9]) if offset == "rows" else offset
    rope.reserve(12)
    rq, rk = rope.rotate(q, k, off)
    both = rope.rotate_heads(torch.cat([q, k], dim=1), off)
    assert torch.equal(both, torch.cat([rq, rk], dim=1))  # the same values: roll by hd/2 is the swap of halves


def test_rotate_heads_table_rows_reused_only_for_the_same_position():
    rope = RoPE(8, max_len=4)
    x = torch.randn(1, 3, 1, 8)
    for pos in (1, 1, 2, 3):
        assert torch.equal(rope.rotate_heads(x, pos), torch.cat(rope.rotate(x[:, :2], x[:, 2:], pos), dim=1))
    rope.reserve(40)  # the tables are rebuilt: rows from the old ones must not be reused
    for pos in (3, 37):
        assert torch.equal(rope.rotate_heads(x, pos), torch.cat(rope.rotate(x[:, :2], x[:, 2:], pos), dim=1))


def test_rmsnorm_step_equals_formula():
    torch.manual_seed(2)
    norm = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(48))
    x = 3 * torch.randn(1, 48)
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    with torch.no_grad():
        torch.testing.assert_close(norm.step(x).double(), ref, rtol=1e-6, atol=1e-6)
        rows = torch.randn(3, 48)
        assert torch.equal(norm.step(rows), norm(rows))  # several rows: forward()
        norm.eps = 1e-2  # a changed eps is read again
        ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-2) * norm.weight.double()
        torch.testing.assert_close(norm.step(x).double(), ref, rtol=1e-6, atol=1e-6)


def _llama_like() -> torch.nn.Module:
    torch.manual_seed(3)
    return qkv.build("gpt-nano", vocab_size=61, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, context_length=64,
                     position="rope", norm="rmsnorm", ffn="swiglu", d_ff=48, bias=False, init_std=0.2).eval()


def test_fp32_step_equals_forward_and_the_previous_step(two_threads, monkeypatch):
    model = _llama_like()
    ids = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(ids).logits[:, -1]
        for fast in (True, False):
            _fast_paths(monkeypatch, fast)
            cache = model.make_cache(1, 16)
            model.prefill(ids[:, :-1], cache)
            if fast:
                got = model.step(ids[:, -1:], cache)
                assert torch.get_num_threads() == 2  # the step restored the thread count
                assert "_decode_joined" in model.decoder.blocks[0].ffn.__dict__  # the fast paths were taken
            else:
                prev = model.step(ids[:, -1:], cache)
        torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got, prev, rtol=1e-5, atol=1e-5)


def test_one_thread_region_restores_the_thread_count_on_error(two_threads):
    model = _llama_like()
    attn = model.decoder.blocks[0].attn
    cache = model.make_cache(1, 8)
    bad_add = torch.zeros(5, 5, 5)  # not the (B * Hkv, G, Tk) the scores have: baddbmm raises inside the region
    with torch.no_grad(), pytest.raises(RuntimeError):
        attn.step(torch.randn(1, 32), 1, cache, 0, bad_add, model.decoder.position, 0)
    assert torch.get_num_threads() == 2
    assert attention.STEP_SERIAL_MAX > 0


def test_rmsnorm_bf16_step_equals_forward_and_formula(monkeypatch):
    torch.manual_seed(5)
    norm = RMSNorm(48, eps=1e-5).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(48))
    x = (3 * torch.randn(1, 48)).bfloat16()
    xd, wd = x.double(), norm.weight.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * wd
    with torch.no_grad():
        want = norm(x)
        monkeypatch.setattr(norm, "forward", lambda *a: pytest.fail("the bf16 row went through forward()"))
        got = norm.step(x)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - ref).abs() <= ref.abs() * 2.0 ** -8 + 1e-6).all()  # one bf16 rounding of the formula
    # forward()'s formula with the mean square summed in another order: equal but for a rare 1-ulp flip
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2.0 ** -7).all()


@pytest.mark.parametrize("batch", [1, 4])
def test_bf16_step_equals_forward_and_the_previous_step(two_threads, monkeypatch, batch):
    """A bf16 step of a Llama-shaped model (batch 4: the products through fp32 tiles; the attention products in fp32;
    forced on as on a CPU without native bf16) against the full forward and against the step with every fast path,
    the tiles and the fp32 attention products off."""
    monkeypatch.setattr(linear, "_NATIVE_BF16", False)
    model = _llama_like().bfloat16()
    ids = torch.randint(0, 61, (batch, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(ids).logits[:, -1].float()
        steps = {}
        for fast in (True, False):
            _fast_paths(monkeypatch, fast)
            monkeypatch.setattr(linear, "BF16_TILE_MIN_ROWS", 4 if fast else 0)
            monkeypatch.setattr(attention, "STEP_BF16_FP32_PRODUCTS", fast)
            cache = model.make_cache(batch, 16)
            model.prefill(ids[:, :-1], cache)
            steps[fast] = model.step(ids[:, -1:], cache).float()
    scale = full.abs().max()
    assert (steps[True] - full).abs().max() <= 0.03 * scale  # bf16 rounding through 2 layers
    assert (steps[True] - steps[False]).abs().max() <= 0.03 * scale
    assert (steps[True].argmax(-1) == full.argmax(-1)).all()


@pytest.mark.parametrize("masked", [False, True])
def test_bf16_step_attention_products_equal_the_bf16_bmm_and_the_formula(masked):
    torch.manual_seed(7)
    B, Hkv, G, Tk, hd = 3, 2, 3, 21, 16
    q = torch.randn(B * Hkv, G, hd).bfloat16()
    cache_k, cache_v = torch.randn(B, Hkv, 32, hd).bfloat16(), torch.randn(B, Hkv, 32, hd).bfloat16()
    k, v = cache_k[:, :, :Tk], cache_v[:, :, :Tk]  # views of a longer cache, as the step reads them
    add = None
    if masked:
        keep = torch.rand(B, Tk) > 0.3
        keep[:, -1] = True
        add = attention.step_scores_bias(B, Hkv * G, Hkv, 1, Tk, bias=None, keep=keep, causal=True,
                                         dtype=torch.bfloat16, device=torch.device("cpu"))
    got = attention._bf16_step_products(q, k, v, add, B * Hkv, Tk, hd)
    kt = k.reshape(B * Hkv, Tk, hd).transpose(1, 2)
    scores = torch.bmm(q, kt) if add is None else torch.baddbmm(add, q, kt)
    want = torch.bmm(torch.softmax(scores, -1), v.reshape(B * Hkv, Tk, hd))  # the bf16 products, as before
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2.0 ** -7 + 1e-3).all()
    s64 = q.double() @ k.double().reshape(B * Hkv, Tk, hd).transpose(1, 2)
    if add is not None:
        s64 = s64 + add.double()
    ref = torch.softmax(s64, -1) @ v.double().reshape(B * Hkv, Tk, hd)
    assert (got.double() - ref).abs().max() <= 0.02 * ref.abs().max()  # bf16 scores, probabilities and output
