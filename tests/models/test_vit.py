"""ViT: patch embedding against an explicit unfold + matmul, the 2-D sinusoidal table against its formula,
position interpolation, forward + backward over variants, errors, and save/load."""

import itertools
import math

import pytest
import torch

import qkv
from qkv.models.vit import ViT, ViTConfig, interpolate_positions, sinusoidal_2d


def tiny(**kw):
    base = dict(image_size=8, patch_size=2, n_channels=1, n_layers=2, d_model=16, n_heads=2, d_ff=32,
                num_labels=3, dropout=0.1)
    base.update(kw)
    return ViT(ViTConfig(**base))


def test_patch_embedding_is_a_linear_map_per_patch():
    model = tiny(n_channels=3)
    x = torch.randn(2, 3, 8, 8)
    got, grid = model.patch_emb(x)
    assert grid == (4, 4)
    W = model.patch_emb.proj.weight.reshape(16, -1)  # (d, C*p*p)
    patches = x.unfold(2, 2, 2).unfold(3, 2, 2)  # (B, C, 4, 4, 2, 2)
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(2, 16, -1)  # row-major patches, (C, p, p) flattened
    torch.testing.assert_close(got, patches @ W.t() + model.patch_emb.proj.bias, atol=1e-5, rtol=1e-5)


def test_sinusoidal_2d_formula():
    gh, gw, d = 3, 5, 8
    t = sinusoidal_2d(gh, gw, d)
    for r, c in [(0, 0), (2, 4), (1, 3)]:
        row = t[r * gw + c]
        for i in range(d // 4):
            w = 1 / 10000 ** (2 * i / (d // 2))
            assert math.isclose(row[2 * i].item(), math.sin(r * w), abs_tol=1e-6)
            assert math.isclose(row[2 * i + 1].item(), math.cos(r * w), abs_tol=1e-6)
            assert math.isclose(row[d // 2 + 2 * i].item(), math.sin(c * w), abs_tol=1e-6)
            assert math.isclose(row[d // 2 + 2 * i + 1].item(), math.cos(c * w), abs_tol=1e-6)


def test_interpolation_keeps_extra_tokens_and_reproduces_constant_tables():
    table = torch.randn(1, 1 + 16, 4)
    table[:, 1:] = torch.tensor([1.0, -2.0, 0.5, 3.0])  # constant over the grid
    new = interpolate_positions(table, 4, (6, 6), n_extra=1)
    assert new.shape == (1, 37, 4)
    torch.testing.assert_close(new[:, 0], table[:, 0])
    torch.testing.assert_close(new[:, 1:], table[:, 1:2].expand(1, 36, 4), atol=1e-5, rtol=0)
    assert torch.equal(interpolate_positions(table, 4, (4, 4)), table)


POOL, POS, BACKENDS, NORMS = ("cls", "mean"), ("learned", "sinusoidal2d", "none"), ("naive", "fused"), \
    ("layernorm", "rmsnorm")


@pytest.mark.parametrize("pooling,pos,attention,norm", list(itertools.product(POOL, POS, BACKENDS, NORMS)))
def test_vit_forward_backward_variants(pooling, pos, attention, norm):
    model = tiny(pooling=pooling, patch_position=pos, attention=attention, norm=norm)
    out = model(torch.randn(3, 1, 8, 8), labels=torch.tensor([0, 2, 1]))
    assert out.logits.shape == (3, 3) and torch.isfinite(out.loss) and int(out.n_targets) == 3
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    # with 2-D sinusoidal positions, a bigger image just gets a bigger table
    if pos == "sinusoidal2d":
        assert model(torch.randn(1, 1, 12, 12)).logits.shape == (1, 3)


def test_vit_attention_weights_over_patches():
    model = tiny(attention="fused").eval()
    out = model(torch.randn(1, 1, 8, 8), return_attentions=True)
    w = out.attentions[0]["self"]
    assert w.shape == (1, 2, 17, 17)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 17))


def test_vit_errors_and_round_trip(tmp_path):
    model = tiny().eval()
    with pytest.raises(ValueError, match="pixel_values"):
        model(torch.randn(2, 3, 8, 8))
    with pytest.raises(ValueError, match="multiple of the patch"):
        model(torch.randn(2, 1, 9, 9))
    with pytest.raises(ValueError, match="labels"):
        model(torch.randn(2, 1, 8, 8), labels=torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(qkv.ConfigError, match="patch_position"):
        qkv.build("vit-digits", patch_position="rope")
    model.save_pretrained(tmp_path)
    again = qkv.from_pretrained(tmp_path).eval()
    x = torch.randn(2, 1, 8, 8)
    assert torch.equal(again(x).logits, model(x).logits)


def test_patch_attention_map_and_overlay(tmp_path):
    from qkv.models.vit import patch_attention, save_attention_overlay

    model = tiny(attention="fused")
    x = torch.rand(2, 1, 8, 8)
    maps = patch_attention(model, x)
    assert maps.shape == (2, 4, 4) and (maps >= 0).all() and (maps.sum((1, 2)) <= 1 + 1e-5).all()
    save_attention_overlay(model, x, str(tmp_path / "att.png"), titles=["a", "b"])
    assert (tmp_path / "att.png").stat().st_size > 1000
