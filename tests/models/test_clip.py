"""CLIP: the symmetric InfoNCE loss against its formula written out, temperature clamp, padding invariance
of the text pooling, forward + backward for causal and bidirectional text towers, nested config round trip."""

import pytest
import torch

import qkv
from qkv.models.clip import CLIP, CLIPConfig
from qkv.models.vit import ViTConfig


def tiny(**kw):
    base = dict(vocab_size=20, n_layers=1, context_length=8, d_model=16, n_heads=2, d_ff=32, embed_dim=12,
                vision=ViTConfig(head="none", image_size=8, patch_size=4, n_channels=1, n_layers=1,
                                 d_model=16, n_heads=2, d_ff=32))
    base.update(kw)
    return CLIP(CLIPConfig(**base))


def batch():
    ids = torch.tensor([[5, 6, 7, 2, 0], [8, 9, 2, 0, 0], [10, 11, 12, 13, 2]])
    return torch.randn(3, 1, 8, 8), ids, (ids != 0).long()


@pytest.mark.parametrize("causal", [True, False])
def test_clip_loss_is_symmetric_infonce_and_trains(causal):
    model = tiny(text_causal=causal)
    px, ids, mask = batch()
    out = model(px, ids, attention_mask=mask)
    img, txt = model.encode_image(px), model.encode_text(ids, mask)
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(3))
    sims = img @ txt.t() * model.logit_scale.exp()
    # -1/2 [ mean_i log softmax_j(s_ij)[i] + mean_j log softmax_i(s_ij)[j] ]
    expect = -(sims.diag() - sims.logsumexp(1)).mean() / 2 - (sims.diag() - sims.logsumexp(0)).mean() / 2
    torch.testing.assert_close(out.loss, expect)
    assert out.logits.shape == (3, 3) and int(out.n_targets) == 3
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.logit_scale.grad.abs() > 0


@pytest.mark.parametrize("causal", [True, False])
def test_text_embedding_ignores_padding(causal):
    model = tiny(text_causal=causal).eval()
    ids = torch.tensor([[5, 6, 7, 2]])
    padded = torch.tensor([[5, 6, 7, 2, 0, 0, 0]])
    a = model.encode_text(ids, torch.ones_like(ids))
    b = model.encode_text(padded, (padded != 0).long())
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_temperature_is_clamped():
    model = tiny(max_logit_scale=50.0)
    with torch.no_grad():
        model.logit_scale.fill_(10.0)
    assert model.scale().item() == pytest.approx(50.0)
    assert tiny().scale().item() == pytest.approx(1 / 0.07, rel=1e-5)  # the paper's initial temperature


def test_clip_errors_and_round_trip(tmp_path):
    model = tiny().eval()
    px, ids, mask = batch()
    with pytest.raises(ValueError, match="pairs"):
        model(px[:2], ids)
    with pytest.raises(qkv.ConfigError, match="vision.head"):
        qkv.build("clip-digits", **{"vision.head": "classify"})
    m = qkv.build("clip-digits", **{"vision.n_layers": 1, "n_layers": 1}).eval()
    assert len(m.visual.encoder.blocks) == 1
    m.save_pretrained(tmp_path)
    again = qkv.from_pretrained(tmp_path).eval()
    px = torch.randn(2, 1, 8, 8)
    ids = torch.tensor([[5, 6, 2], [7, 2, 0]])
    torch.testing.assert_close(again(px, ids).logits, m(px, ids).logits, rtol=0, atol=0)
    z = m.zero_shot_logits(px, ids)
    assert z.shape == (2, 2)
