"""The small DETR (qkv.models.detr): its 2-D sine table against the formula in float64, its frozen BatchNorm
against torch's BatchNorm2d in eval mode, the output shapes and ranges, the set loss and its gradients
(auxiliary layers included), a folder round trip, a few optimizer steps that fit one canvas, and bad input
as one clear error. Parity with transformers' DetrForObjectDetection: tests/interop/test_detr_parity.py."""

from __future__ import annotations

import math

import pytest
import torch

import qkv
from qkv.config import ConfigError, from_dict
from qkv.models.detr import DETR, DETRConfig, FrozenBatchNorm2d, sine_position_embedding, sine_position_grid
from qkv.models.resnet import ResNetConfig

pytest.importorskip("scipy")


def tiny(**kw) -> DETRConfig:
    backbone = ResNetConfig(image_size=32, n_channels=1, stem="cifar", stem_width=8, depths=[1, 1, 1],
                            widths=[8, 16, 16], head="none")
    base = dict(backbone=backbone, d_model=32, encoder_heads=2, decoder_heads=2, encoder_d_ff=64,
                decoder_d_ff=64, num_queries=6, num_labels=3, dropout=0.0)
    return DETRConfig(**{**base, **kw})


def targets():
    return [{"class_labels": torch.tensor([0, 2]),
             "boxes": torch.tensor([[0.25, 0.3, 0.3, 0.3], [0.7, 0.7, 0.35, 0.4]])},
            {"class_labels": torch.zeros(0, dtype=torch.long), "boxes": torch.zeros(0, 4)}]


def test_sine_grid_is_the_formula_in_float64():
    h, w, d, temp = 3, 5, 16, 10000.0
    got = sine_position_grid(h, w, d, temp, dtype=torch.float64).view(h, w, d)
    npf = d // 2
    for i in range(h):
        for j in range(w):
            for half, (coord, n) in enumerate(((i + 1, h), (j + 1, w))):
                a = coord / (n + 1e-6) * 2 * math.pi
                for c in range(npf):
                    angle = a / temp ** (2 * (c // 2) / npf)
                    want = math.sin(angle) if c % 2 == 0 else math.cos(angle)
                    assert got[i, j, half * npf + c].item() == pytest.approx(want, abs=1e-12)


def test_sine_tables_equal_transformers():
    detr = pytest.importorskip("transformers.models.detr.modeling_detr")
    table = detr.DetrSinePositionEmbedding(16, normalize=True)
    ref = table(torch.Size([1, 32, 4, 7]), "cpu", torch.float32)
    torch.testing.assert_close(sine_position_grid(4, 7, 32), ref[0].flatten(1).T)
    keep = torch.ones(2, 4, 7, dtype=torch.bool)
    keep[1, 3:], keep[1, :, 5:] = False, False  # the second image padded below and to the right
    ref = table(torch.Size([2, 32, 4, 7]), "cpu", torch.float32, mask=keep)
    torch.testing.assert_close(sine_position_embedding(keep, 32), ref.flatten(2).transpose(1, 2))


def test_frozen_batch_norm_is_batch_norm_in_eval():
    bn = torch.nn.BatchNorm2d(5).eval()
    with torch.no_grad():
        for t in (bn.weight, bn.bias, bn.running_mean):
            t.normal_()
        bn.running_var.uniform_(0.5, 2.0)
    frozen = FrozenBatchNorm2d(5)
    frozen.load_state_dict({k: v for k, v in bn.state_dict().items() if k != "num_batches_tracked"})
    x = torch.randn(2, 5, 4, 4)
    torch.testing.assert_close(frozen(x), bn(x))
    assert not list(frozen.parameters())  # nothing to train


@pytest.mark.parametrize("aux", [False, True])
def test_outputs_loss_and_gradients(aux):
    torch.manual_seed(0)
    model = DETR(tiny(aux_loss=aux, decoder_layers=3))
    x = torch.randn(2, 1, 32, 32)
    out = model(x, labels=targets())
    assert out.logits.shape == (2, 6, 4) and out.pred_boxes.shape == (2, 6, 4)
    assert bool(((out.pred_boxes > 0) & (out.pred_boxes < 1)).all())
    assert len(out.aux_outputs) == (2 if aux else 0)
    assert ("loss_ce_1" in out.loss_terms) == aux
    weighted = sum(out.loss_terms[k] * w for k, w in (("loss_ce", 1), ("loss_bbox", 5), ("loss_giou", 2)))
    if not aux:
        torch.testing.assert_close(out.loss, weighted)
    out.loss.backward()
    assert model.query_embed.weight.grad.abs().sum() > 0
    assert model.backbone.stem.conv.conv.weight.grad.abs().sum() > 0


def test_the_aux_outputs_are_the_earlier_layers_through_the_shared_heads():
    torch.manual_seed(0)
    model = DETR(tiny(aux_loss=True, decoder_layers=2)).eval()
    x = torch.randn(1, 1, 32, 32)
    out = model(x)
    memory, pos, _ = model.encode(x)
    query_pos = model.query_embed.weight[None]
    first = model.decoder[0](torch.zeros_like(query_pos), query_pos, memory, pos)
    logits, boxes = model.heads(model.decoder_norm(first))
    torch.testing.assert_close(out.aux_outputs[0][0], logits)
    torch.testing.assert_close(out.aux_outputs[0][1], boxes)
    last = model.decoder[1](first, query_pos, memory, pos)  # not renormalised in between (the paper's)
    torch.testing.assert_close(out.logits, model.heads(model.decoder_norm(last))[0])


def test_an_all_ones_pixel_mask_changes_nothing():
    torch.manual_seed(0)
    model = DETR(tiny()).eval()
    x = torch.randn(2, 1, 32, 32)
    torch.testing.assert_close(model(x, pixel_mask=torch.ones(2, 32, 32, dtype=torch.long)).logits,
                               model(x).logits)


def test_a_few_steps_fit_one_canvas():
    torch.manual_seed(0)
    model = DETR(tiny(aux_loss=False))
    x = torch.randn(2, 1, 32, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(25):
        loss = model(x, labels=targets()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


def test_folder_round_trip_and_preset(tmp_path):
    torch.manual_seed(0)
    model = DETR(tiny(frozen_bn=True)).eval()
    x = torch.randn(1, 1, 32, 32)
    loaded = qkv.from_pretrained(model.save_pretrained(tmp_path / "detr")).eval()
    assert isinstance(loaded, DETR) and loaded.config == model.config
    torch.testing.assert_close(loaded(x).pred_boxes, model(x).pred_boxes, rtol=0, atol=0)
    small = qkv.build("detr-small")
    assert small.kind == "detection" and small.config.backbone.n_channels == 1
    assert DETR.config_for_task("detection", {"image_size": 96, "n_channels": 3, "num_labels": 10}) == {
        "num_labels": 10, "backbone.image_size": 96, "backbone.n_channels": 3}


def test_bad_input_is_one_clear_error():
    model = DETR(tiny()).eval()
    with pytest.raises(ValueError, match=r"pixel_values must be \(B, 1, H, W\).*got shape \(2, 3, 32, 32\)"):
        model(torch.randn(2, 3, 32, 32))
    with pytest.raises(ValueError, match=r"pixel_mask must be \(B, H, W\) = \(1, 32, 32\)"):
        model(torch.randn(1, 1, 32, 32), pixel_mask=torch.ones(1, 1, 32, 32))
    with pytest.raises(ValueError, match="must be floats"):
        model(torch.zeros(1, 1, 32, 32, dtype=torch.uint8))
    bad = [{"class_labels": torch.tensor([3]), "boxes": torch.tensor([[0.5, 0.5, 0.2, 0.2]])}]
    with pytest.raises(ValueError, match=r"class_labels must be in \[0, 3\)"):
        model(torch.randn(1, 1, 32, 32), labels=bad)
    with pytest.raises(ConfigError, match="backbone.head must be 'none'"):
        DETR(tiny(backbone=ResNetConfig(head="classify")))
    with pytest.raises(ConfigError, match="multiple of 4"):
        DETR(tiny(d_model=30, encoder_heads=1, decoder_heads=1))
    with pytest.raises(ConfigError, match="activation"):
        DETR(tiny(activation="swiglu"))
    with pytest.raises(ConfigError, match="unknown key 'queries'"):
        from_dict(DETRConfig, {"queries": 10})
