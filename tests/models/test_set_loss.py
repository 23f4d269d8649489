"""DETR's set-prediction loss (qkv.models.set_loss) against transformers' own: GIoU, the Hungarian matching
(HungarianMatcher) and every loss term with and without auxiliary decoding losses (ImageLoss /
ForObjectDetectionLoss) on random predictions and targets of 0 to 4 boxes per image; gradients flow."""

from __future__ import annotations

import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy")

from qkv.models.set_loss import (  # noqa: E402
    SetLossWeights,
    center_to_corners,
    corners_to_center,
    generalized_box_iou,
    hungarian_match,
    set_loss,
)

hf_loss = pytest.importorskip("transformers.loss.loss_for_object_detection")


def random_case(seed, B=3, N=10, C=5, counts=(2, 0, 4)):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, N, C + 1, generator=g)
    boxes = torch.rand(B, N, 4, generator=g) * 0.5 + torch.tensor([0.25, 0.25, 0.0, 0.0])
    boxes[..., 2:] = boxes[..., 2:] * 0.4 + 0.05
    targets = []
    for m in counts:
        b = torch.rand(m, 4, generator=g) * 0.5 + torch.tensor([0.25, 0.25, 0.0, 0.0])
        b[:, 2:] = b[:, 2:] * 0.4 + 0.05
        targets.append({"class_labels": torch.randint(C, (m,), generator=g), "boxes": b})
    return logits, boxes, targets


def test_box_formats_and_giou():
    _, boxes, _ = random_case(0)
    b = boxes.reshape(-1, 4)
    torch.testing.assert_close(corners_to_center(center_to_corners(b)), b)
    c = center_to_corners(b)
    torch.testing.assert_close(generalized_box_iou(c, c[:7]), hf_loss.generalized_box_iou(c, c[:7]))
    assert torch.allclose(torch.diag(generalized_box_iou(c, c)), torch.ones(len(c)))
    with pytest.raises(ValueError, match="corner boxes"):
        generalized_box_iou(c[:, [2, 3, 0, 1]], c)


@pytest.mark.parametrize("seed", range(4))
def test_matching_equals_transformers(seed):
    logits, boxes, targets = random_case(seed)
    w = SetLossWeights(class_cost=1.0, bbox_cost=5.0, giou_cost=2.0)
    ref = hf_loss.HungarianMatcher(class_cost=1.0, bbox_cost=5.0, giou_cost=2.0)(
        {"logits": logits, "pred_boxes": boxes}, targets)
    got = hungarian_match(logits, boxes, targets, w)
    for (i, j), (ri, rj) in zip(got, ref, strict=True):
        assert torch.equal(i, ri) and torch.equal(j, rj)
        assert len(i) == len(set(i.tolist()))  # one prediction per target


@pytest.mark.parametrize("aux", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_losses_equal_transformers(seed, aux):
    logits, boxes, targets = random_case(seed)
    n_layers = 3
    aux_layers = [random_case(100 + seed + k)[:2] for k in range(n_layers - 1)] if aux else None
    config = types.SimpleNamespace(class_cost=1, bbox_cost=5, giou_cost=2, num_labels=logits.shape[-1] - 1,
                                   eos_coefficient=0.1, auxiliary_loss=aux, bbox_loss_coefficient=5,
                                   giou_loss_coefficient=2, decoder_layers=n_layers)
    kw = {}
    if aux:  # transformers reads every layer's outputs stacked, the last one included
        kw = {"outputs_class": torch.stack([lg for lg, _ in aux_layers] + [logits]),
              "outputs_coord": torch.stack([bx for _, bx in aux_layers] + [boxes])}
    ref_total, ref_terms, _ = hf_loss.ForObjectDetectionLoss(logits, targets, "cpu", boxes, config, **kw)
    total, terms = set_loss(logits, boxes, targets, SetLossWeights(), aux=aux_layers)
    assert set(terms) == set(ref_terms)
    for k in terms:
        torch.testing.assert_close(terms[k], torch.as_tensor(ref_terms[k]).float(), msg=k)
    torch.testing.assert_close(total, ref_total)


def test_gradients_reach_logits_and_boxes():
    logits, boxes, targets = random_case(7)
    logits.requires_grad_(True)
    boxes.requires_grad_(True)
    total, _ = set_loss(logits, boxes, targets)
    total.backward()
    assert logits.grad.abs().sum() > 0 and boxes.grad.abs().sum() > 0
    # only matched predictions get a box gradient: 6 targets -> 6 boxes
    assert int((boxes.grad.abs().sum(-1) > 0).sum()) == 6


def test_bad_targets():
    logits, boxes, targets = random_case(0)
    with pytest.raises(ValueError, match="3 images but 2 target sets"):
        set_loss(logits, boxes, targets[:2])
    targets[0]["boxes"] = targets[0]["boxes"][:1]
    with pytest.raises(ValueError, match="target 0: 2 labels but 1 boxes"):
        set_loss(logits, boxes, targets)
