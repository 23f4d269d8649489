"""Positional encodings against the papers' formulas written independently (math module, float64)."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.nn.position import ALiBi, Learned, NoPosition, RoPE, Sinusoidal, alibi_slopes, build_position


@pytest.mark.parametrize("d_model", [16, 7])
def test_sinusoidal_table_is_the_2017_formula(d_model):
    # PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))  (Vaswani 2017, 3.5)
    n = 50
    pe = Sinusoidal(d_model, n)
    expected = torch.zeros(n, d_model, dtype=torch.float64)
    for pos in range(n):
        for dim in range(d_model):
            angle = pos / 10000 ** ((dim - dim % 2) / d_model)
            expected[pos, dim] = math.sin(angle) if dim % 2 == 0 else math.cos(angle)
    torch.testing.assert_close(pe.table.double(), expected, atol=1e-6, rtol=0)
    x = torch.randn(2, 5, d_model)
    torch.testing.assert_close(pe.embed(x), x + expected[:5].float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(pe.embed(x, offset=9), x + expected[9:14].float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("cls", [Sinusoidal, Learned])
def test_absolute_positions_raise_past_max_len(cls):
    pe = cls(8, 10)
    pe.embed(torch.zeros(1, 10, 8))  # exactly the context is fine
    with pytest.raises(ValueError, match="context is 10 positions"):
        pe.embed(torch.zeros(1, 11, 8))
    with pytest.raises(ValueError, match="context"):
        pe.embed(torch.zeros(1, 3, 8), offset=8)
    with pytest.raises(ValueError, match="context"):
        pe.embed(torch.zeros(2, 3, 8), offset=torch.tensor([0, 8]))


@pytest.mark.parametrize("cls", [Sinusoidal, Learned])
def test_per_sequence_offsets_equal_int_offsets_row_by_row(cls):
    pe = cls(8, 20)
    if cls is Learned:
        torch.nn.init.normal_(pe.weight)
    offsets = torch.tensor([0, 5, 11, -2])  # -2: a left-padded row, its padding clamped to position 0
    x = torch.randn(4, 4, 8)
    batched = pe.embed(x, offset=offsets)
    for b in range(4):
        torch.testing.assert_close(batched[b], pe.embed(x[b : b + 1], offset=int(offsets[b]))[0])
    table = pe.table if cls is Sinusoidal else pe.weight
    torch.testing.assert_close(batched[3], x[3] + table[torch.tensor([0, 0, 0, 1])].to(x.dtype))


def test_rope_negative_int_offset_is_clamped_like_a_tensor_offset():
    rope = RoPE(8, 20)
    q, k = torch.randn(2, 1, 2, 4, 8).unbind(0)
    for got, want in zip(rope.rotate(q, k, -2), rope.rotate(q, k, torch.tensor([-2])), strict=True):
        torch.testing.assert_close(got, want)


def test_learned_embed_adds_its_rows():
    pe = Learned(4, 6)
    torch.nn.init.normal_(pe.weight)
    x = torch.randn(2, 3, 4)
    torch.testing.assert_close(pe.embed(x, offset=2), x + pe.weight[2:5])


# -- RoPE ------------------------------------------------------------------------------------------


def rope_reference(x: torch.Tensor, pos: int, base: float = 10000.0) -> torch.Tensor:
    """Rotate a (hd,) vector: pair (i, i + hd/2) turns by angle pos * base^(-2i/hd) (half-split layout)."""
    hd = x.shape[-1]
    out = x.double().clone()
    for i in range(hd // 2):
        a = pos * base ** (-2 * i / hd)
        x1, x2 = float(x[i]), float(x[i + hd // 2])
        out[i] = x1 * math.cos(a) - x2 * math.sin(a)
        out[i + hd // 2] = x1 * math.sin(a) + x2 * math.cos(a)
    return out


def rotate_at(rope: RoPE, v: torch.Tensor, pos) -> torch.Tensor:
    """Rotate a (B, H, T, hd) tensor as a query placed at position `pos` (int or (B,) tensor)."""
    return rope.rotate(v, v, pos)[0]


def test_rope_matches_rotation_formula():
    rope = RoPE(8)
    x = torch.randn(8)
    for pos in (0, 1, 7, 100):
        got = rotate_at(rope, x.view(1, 1, 1, 8), pos)[0, 0, 0]
        torch.testing.assert_close(got.double(), rope_reference(x, pos), atol=1e-5, rtol=0)


def test_rope_scores_depend_only_on_relative_offset_and_norms_are_kept():
    rope = RoPE(16, max_len=8)  # small table: positions up to 300 make it grow on demand
    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    for m, n in [(5, 2), (3, 3), (0, 9)]:
        scores = []
        for shift in (0, 1, 37, 300):
            qm, kn = rotate_at(rope, q, m + shift), rotate_at(rope, k, n + shift)
            torch.testing.assert_close(qm.norm(dim=-1), q.norm(dim=-1), atol=1e-5, rtol=0)
            torch.testing.assert_close(kn.norm(dim=-1), k.norm(dim=-1), atol=1e-5, rtol=0)
            scores.append((qm * kn).sum(-1))
        for s in scores[1:]:
            torch.testing.assert_close(s, scores[0], atol=1e-4, rtol=0)
    # ... and the score does change with the relative offset (the test above is not vacuous)
    s0 = (rotate_at(rope, q, 0) * rotate_at(rope, k, 0)).sum(-1)
    s3 = (rotate_at(rope, q, 3) * rotate_at(rope, k, 0)).sum(-1)
    assert not torch.allclose(s0, s3, atol=1e-3)


def test_rope_sequence_positions_and_per_sequence_offsets():
    rope = RoPE(8)
    q, k = torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8)
    # a sequence starting at offset o rotates token t by position o + t
    rq, rk = rope.rotate(q, k, 4)
    for t in range(5):
        torch.testing.assert_close(rq[0, 1, t].double(), rope_reference(q[0, 1, t], 4 + t), atol=1e-5, rtol=0)
        torch.testing.assert_close(rk[2, 0, t].double(), rope_reference(k[2, 0, t], 4 + t), atol=1e-5, rtol=0)
    offsets = torch.tensor([0, 3, 9])
    bq, bk = rope.rotate(q, k, offsets)
    for b in range(3):
        iq, ik = rope.rotate(q[b : b + 1], k[b : b + 1], int(offsets[b]))
        torch.testing.assert_close(bq[b], iq[0])
        torch.testing.assert_close(bk[b], ik[0])


def test_rope_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="even head dimension"):
        RoPE(7)


# -- ALiBi -----------------------------------------------------------------------------------------


def test_alibi_slopes_8_heads_are_the_papers():
    # Press et al. 2022, section 3: for 8 heads the slopes are 1/2, 1/4, ..., 1/256
    expected = [1 / 2 ** i for i in range(1, 9)]
    assert alibi_slopes(8).tolist() == pytest.approx(expected, rel=1e-6)


def test_alibi_slopes_12_heads_interpolate():
    # Not a power of two: the 8 slopes of 8 heads (2^-8i/8 = 2^-i, i = 1..8), then the odd-indexed
    # slopes of 16 heads (2^-8i/16 = 2^-i/2 for i = 1, 3, 5, 7) -- the paper's reference code.
    expected = [2.0 ** -i for i in range(1, 9)] + [2.0 ** (-i / 2) for i in (1, 3, 5, 7)]
    assert alibi_slopes(12).tolist() == pytest.approx(expected, rel=1e-6)


def test_alibi_bias_is_minus_slope_times_distance_bottom_right():
    alibi = ALiBi(4)
    slopes = [2.0 ** -(2 * i) for i in range(1, 5)]  # 4 heads: 2^(-8/4 * i)
    q_len, k_len = 3, 5
    b = alibi.bias(q_len, k_len)
    assert b.shape == (1, 4, q_len, k_len)
    for h in range(4):
        for i in range(q_len):
            for j in range(k_len):
                assert (float(b[0, h, i, j])
                        == pytest.approx(-slopes[h] * abs(i + k_len - q_len - j), rel=1e-6))


def test_identity_hooks():
    x, q, k = torch.randn(2, 3, 8), torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    for pe in (NoPosition(), ALiBi(2)):
        assert pe.embed(x, 5) is x
        assert pe.rotate(q, k, 5) == (q, k)
    for pe in (NoPosition(), Sinusoidal(8, 10), Learned(8, 10), RoPE(4)):
        assert pe.bias(3, 3) is None
    for pe in (Sinusoidal(8, 10), Learned(8, 10)):
        assert pe.rotate(q, k, 1) == (q, k)


def test_build_position_rejects_unknown():
    with pytest.raises(ValueError, match="unknown position encoding"):
        build_position("xpos", d_model=8, n_heads=2, max_len=8)


def test_rope_table_grown_after_a_bf16_cast_keeps_exact_frequencies():
    # model.to(bfloat16) rounds every floating buffer; a table grown later must not inherit that rounding
    rope = RoPE(8, max_len=16).to(torch.bfloat16)
    x = torch.randn(1, 1, 1, 8)
    got = rotate_at(rope, x, 3000)[0, 0, 0]  # past the 16-row table: it grows
    torch.testing.assert_close(got.double(), rope_reference(x[0, 0, 0], 3000), atol=1e-3, rtol=0)


@pytest.mark.parametrize("skip,offset", [(0, 0), (0, 3), (2, 0), (2, 4)])
def test_learned_table_read_by_slice_equals_the_gather_with_its_gradients(skip, offset):
    # an int offset reads a slice of the table; the reference is the gather of the same rows (what a
    # tensor offset still does): same output and the same gradients for the table and the input, bit for bit
    torch.manual_seed(0)
    pe = Learned(8, 10, skip=skip)
    with torch.no_grad():
        pe.weight.normal_()
    x = torch.randn(3, 5, 8, requires_grad=True)
    w_ref = pe.weight.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = pe.embed(x, offset)
    ref = x_ref + w_ref[torch.arange(offset + skip, offset + skip + 5)]
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(pe.weight.grad, w_ref.grad) and torch.equal(x.grad, x_ref.grad)
    rows = torch.zeros(10 + skip, dtype=torch.bool)
    rows[offset + skip: offset + skip + 5] = True
    assert pe.weight.grad[~rows].abs().sum() == 0  # rows no position read get no gradient
    # a per-row tensor offset (the gather path) gives the same rows
    assert torch.equal(pe.embed(x, torch.full((3,), offset)), out)
