"""HF ResNetModel / ResNetForImageClassification with tiny random configs (basic and bottleneck layers), saved
to tmp_path, load into qkv.ResNet: outputs equal within 1e-4; qkv -> HF export loads back in transformers."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qkv.interop import load_hf  # noqa: E402
from qkv.interop.resnet import export_resnet  # noqa: E402


def _cfg(**kw):
    base = dict(num_channels=3, embedding_size=8, hidden_sizes=[8, 16, 24], depths=[1, 2, 1],
                layer_type="basic")
    base.update(kw)
    return transformers.ResNetConfig(**base)


def _randomise(model):
    # HF init sets BN to (1, 0) with running statistics (0, 1): perturb everything, variances kept positive,
    # so that each weight and each running statistic is checked
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("running_var"):
                t.uniform_(0.5, 2.0)
            elif t.is_floating_point():
                t.add_(torch.randn_like(t) * 0.1)


def _hf(cls, tmp_path, seed=0, **kw):
    torch.manual_seed(seed)
    hf = cls(_cfg(**kw)).eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("kw", [
    dict(layer_type="basic"),
    dict(layer_type="bottleneck", hidden_sizes=[16, 32, 48]),
    dict(layer_type="bottleneck", hidden_sizes=[16, 32, 48], downsample_in_bottleneck=True,
         downsample_in_first_stage=True),
    dict(layer_type="basic", num_channels=1),
])
def test_resnet_classifier_parity(tmp_path, kw):
    hf = _hf(transformers.ResNetForImageClassification, tmp_path, num_labels=5, **kw)
    ours = load_hf(tmp_path)
    assert type(ours).__name__ == "ResNet" and ours.config.block == kw["layer_type"]
    x = torch.randn(3, kw.get("num_channels", 3), 40, 40)
    with torch.no_grad():
        ref = hf(pixel_values=x).logits
        got = ours(x).logits
    assert got.shape == (3, 5)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_resnet_model_hidden_and_pooler_parity(tmp_path):
    hf = _hf(transformers.ResNetModel, tmp_path, seed=1, layer_type="bottleneck", hidden_sizes=[16, 32, 48])
    ours = load_hf(tmp_path)
    assert ours.config.head == "none" and ours.classifier is None
    x = torch.randn(2, 3, 33, 47)  # any size: a convolutional network has no fixed grid
    with torch.no_grad():
        ref = hf(pixel_values=x)
        out = ours(x)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.pooled, ref.pooler_output.flatten(1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head", ["classify", "none"])
def test_resnet_export_round_trip(tmp_path, head):
    import qkv

    torch.manual_seed(2)
    ours = qkv.build("resnet-18", depths=[1, 1], widths=[8, 16], stem_width=8, num_labels=4, head=head).eval()
    _randomise(ours)
    export_resnet(ours, tmp_path, id2label={0: "cat", 1: "dog", 2: "fox", 3: "owl"})
    cls = transformers.ResNetForImageClassification if head == "classify" else transformers.ResNetModel
    hf = cls.from_pretrained(tmp_path).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        if head == "classify":
            torch.testing.assert_close(hf(pixel_values=x).logits, ours(x).logits, atol=1e-4, rtol=1e-4)
            assert hf.config.id2label[1] == "dog"
        else:
            torch.testing.assert_close(hf(pixel_values=x).pooler_output.flatten(1), ours(x).pooled, atol=1e-4,
                                       rtol=1e-4)
    again = load_hf(tmp_path)
    torch.testing.assert_close(again(x).pooled, ours(x).pooled, atol=0, rtol=0)


def test_resnet_export_refuses_what_hf_cannot_hold(tmp_path):
    import qkv
    from qkv.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="cifar"):
        export_resnet(qkv.build("resnet-8-cifar"), tmp_path / "x")
    assert not (tmp_path / "x").exists()  # nothing written


def test_resnet_folders_with_other_layouts_are_refused(tmp_path):
    from qkv.checkpoint import CheckpointError

    hf = _hf(transformers.ResNetForImageClassification, tmp_path / "a", num_labels=3)
    meta = json.loads((tmp_path / "a" / "config.json").read_text())
    # file has 2 in stage 2
    (tmp_path / "a" / "config.json").write_text(json.dumps({**meta, "depths": [1, 1, 1]}))
    with pytest.raises(CheckpointError, match=r"unexpected key.*stages\.1\.layers\.1"):
        load_hf(tmp_path / "a")
    # transformers' hidden_act acts on the stem and after the sums only; loaded as ours it gave logits 0.2
    # away
    (tmp_path / "a" / "config.json").write_text(json.dumps({**meta, "hidden_act": "gelu"}))
    with pytest.raises(CheckpointError, match="hidden_act 'gelu'"):
        load_hf(tmp_path / "a")
    del hf
