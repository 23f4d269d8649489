"""Swin: window partition/reverse, the shifted-window mask against a brute-force neighbourhood rule, the
relative position bias, the perturbation test (shifted windows let information cross window borders, plain
windows do not), and forward + backward over block variants."""

import itertools

import pytest
import torch

from qkv.config import ConfigError
from qkv.models.registry import build
from qkv.models.swin import (
    Swin,
    SwinConfig,
    SwinLayer,
    WindowRelativeBias,
    shifted_window_mask,
    window_partition,
    window_reverse,
)


def test_window_partition_round_trip_and_layout():
    x = torch.randn(2, 8, 12, 5)
    w = window_partition(x, 4)
    assert w.shape == (2 * 2 * 3, 16, 5)
    # window 0 of image 0 is the top-left 4x4 block, row-major; window 4 is row 1, column 1 of image 0
    torch.testing.assert_close(w[0], x[0, :4, :4].reshape(16, 5), rtol=0, atol=0)
    torch.testing.assert_close(w[4], x[0, 4:8, 4:8].reshape(16, 5), rtol=0, atol=0)
    torch.testing.assert_close(w[6], x[1, :4, :4].reshape(16, 5), rtol=0, atol=0)
    assert torch.equal(window_reverse(w, 4, 8, 12), x)
    with pytest.raises(ValueError, match="multiple of the window"):
        window_partition(x, 5)


@pytest.mark.parametrize("H,window,shift", [(8, 4, 2), (12, 4, 2), (9, 3, 1)])
def test_shifted_mask_matches_brute_force(H, window, shift):
    mask = shifted_window_mask(H, H, window, shift)
    # brute force: roll the coordinate grid as the layer rolls the features; two tokens of a window may attend
    # iff they were within the same w x w neighbourhood before the roll (no wrap-around between them)
    ys, xs = torch.meshgrid(torch.arange(H), torch.arange(H), indexing="ij")
    coords = torch.stack([ys, xs], -1).float()
    rolled = torch.roll(coords, shifts=(-shift, -shift), dims=(0, 1)).unsqueeze(0)
    win = window_partition(rolled, window)  # (nW, N, 2) original coordinates
    d = (win.unsqueeze(2) - win.unsqueeze(1)).abs()  # (nW, N, N, 2)
    expect = (d < window).all(-1)
    assert torch.equal(mask, expect)


def test_relative_bias_depends_only_on_offset():
    torch.manual_seed(0)
    rb = WindowRelativeBias(3, n_heads=2)
    torch.nn.init.normal_(rb.table)
    b = rb.bias(9, 9)[0]  # (H, N, N)
    coords = [(i // 3, i % 3) for i in range(9)]
    for (i, ci), (j, cj) in itertools.product(enumerate(coords), repeat=2):
        dy, dx = ci[0] - cj[0], ci[1] - cj[1]
        expect = rb.table[(dy + 2) * 5 + (dx + 2)]
        torch.testing.assert_close(b[:, i, j], expect, rtol=0, atol=0)
    assert rb.index.unique().numel() == 25  # every offset of (2w-1)^2 is used


def _layer(shift):
    cfg = SwinConfig(d_model=16, n_heads=2, attention="naive")
    return SwinLayer(cfg, 16, 2, resolution=8, window=4, shift=shift, d_ff=32).eval()


def test_unshifted_layer_keeps_information_inside_windows():
    torch.manual_seed(0)
    layer = _layer(0)
    x = torch.randn(1, 8, 8, 16)
    x2 = x.clone()
    # perturb a token of the top-left window (not a constant: LayerNorm removes those)
    x2[0, 0, 0] += torch.randn(16)
    with torch.no_grad():
        d = (layer(x2)[0] - layer(x)[0]).abs().sum(-1)[0]  # (8, 8) change per token
    assert d[:4, :4].min() > 0  # every token of its window sees it
    assert d[4:, :].max() == 0 and d[:, 4:].max() == 0  # no other window does


def test_shifted_layer_crosses_window_borders_but_not_wraparound():
    torch.manual_seed(0)
    layer = _layer(2)
    x = torch.randn(1, 8, 8, 16)
    x2 = x.clone()
    x2[0, 3, 3] += torch.randn(16)  # bottom-right corner of the unshifted top-left window
    with torch.no_grad():
        d = (layer(x2)[0] - layer(x)[0]).abs().sum(-1)[0]
    # the shifted window covering rows/cols 2..5 straddles four unshifted windows: the change reaches them
    assert d[4, 4] > 0 and d[2, 5] > 0 and d[5, 2] > 0
    assert d[6:, :].max() == 0 and d[:, 6:].max() == 0
    # a token at the image corner is in a rolled window with the opposite corner, but the mask separates them
    x3 = x.clone()
    x3[0, 0, 0] += torch.randn(16)
    with torch.no_grad():
        d = (layer(x3)[0] - layer(x)[0]).abs().sum(-1)[0]
    assert d[7, 7] == 0 and d[0, 7] == 0 and d[7, 0] == 0
    assert d[1, 1] > 0


NORMS, FFNS, BACKENDS = ("layernorm", "rmsnorm"), ("gelu", "swiglu"), ("naive", "fused")


@pytest.mark.parametrize("norm,ffn,attention", list(itertools.product(NORMS, FFNS, BACKENDS)))
def test_swin_forward_backward_variants(norm, ffn, attention):
    cfg = SwinConfig(image_size=8, patch_size=1, n_channels=1, depths=[2, 1], window_size=4, d_model=8,
                     n_heads=2, num_labels=3, norm=norm, ffn=ffn, attention=attention, dropout=0.1)
    model = Swin(cfg)
    out = model(torch.randn(4, 1, 8, 8), labels=torch.tensor([0, 1, 2, 1]))
    assert out.logits.shape == (4, 3) and torch.isfinite(out.loss)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_swin_tiny_size_and_errors():
    # Liu et al. 2021, Table 1: Swin-T has 28M parameters (28.3M in the reference implementation)
    assert abs(build("swin-tiny").num_parameters() / 1e6 - 28.29) < 0.05
    with pytest.raises(ConfigError, match="window_size"):
        build("swin-tiny", window_size=3)  # a 56x56 grid is not a multiple of 3
    model = build("swin-digits")
    with pytest.raises(ValueError, match="pixel_values"):
        model(torch.randn(2, 1, 12, 12))


def test_swin_save_load_round_trip(tmp_path):
    import qkv

    model = build("swin-digits").eval()
    model.save_pretrained(tmp_path)
    again = qkv.from_pretrained(tmp_path).eval()
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(again(x).logits, model(x).logits, rtol=0, atol=0)
