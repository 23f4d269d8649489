"""HF SwinModel / SwinForImageClassification with tiny random configs, saved to tmp_path, load into qkv.Swin:
outputs equal within 1e-4 (shifted and unshifted windows, patch merging, the final norm and pooling)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qkv.interop import load_hf  # noqa: E402


def _cfg(**kw):
    base = dict(image_size=32, patch_size=2, num_channels=3, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                window_size=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    base.update(kw)
    return transformers.SwinConfig(**base)


def _randomise(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


@pytest.mark.parametrize("kw", [{}, dict(depths=[2, 2, 2], num_heads=[1, 2, 4], num_channels=1, image_size=16,
                                         window_size=2), dict(window_size=8, depths=[2, 4], mlp_ratio=2.0)])
def test_swin_classifier_parity(tmp_path, kw):
    torch.manual_seed(0)
    hf = transformers.SwinForImageClassification(_cfg(num_labels=5, **kw)).eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    c = hf.config
    x = torch.randn(2, c.num_channels, c.image_size, c.image_size)
    with torch.no_grad():
        ref = hf(pixel_values=x).logits
        got = ours(x).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_swin_model_hidden_parity(tmp_path):
    torch.manual_seed(1)
    hf = transformers.SwinModel(_cfg()).eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    assert ours.classifier is None
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = hf(pixel_values=x)
        out = ours(x)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.pooled, ref.pooler_output, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("change, message", [({"num_heads": [2, 3]}, "do not double"),
                                             ({"use_absolute_embeddings": True}, "use_absolute_embeddings"),
                                             ({"window_size": 3}, "not supported")])
def test_swin_layouts_ours_cannot_hold_are_refused(tmp_path, change, message):
    from qkv.checkpoint import CheckpointError

    transformers.SwinForImageClassification(_cfg()).save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**meta, **change}))
    with pytest.raises(CheckpointError, match=message):
        load_hf(tmp_path)
