"""DETR's set-prediction loss (Carion et al. 2020 §3.1): a detector predicts a fixed set of N (class, box)
pairs, the targets are matched to them one-to-one by the Hungarian algorithm, and the matched pairs are
scored (boxes are cx, cy, w, h in [0, 1]).

    cost(i, j) = w_class * -p_i(c_j) + w_l1 * |b_i - b_j|_1 + w_giou * -GIoU(b_i, b_j)
    match      = scipy.optimize.linear_sum_assignment(cost) per image        (min(N, targets) pairs)
    loss_ce    = cross-entropy of every prediction against its matched class or "no object" (the last class),
                 the no-object class weighted by eos_coef (0.1: most of the N predictions are empty)
    loss_bbox  = sum of L1 distances of the matched boxes / number of target boxes
    loss_giou  = sum of (1 - GIoU) of the matched boxes / number of target boxes
    cardinality_error = |predicted non-empty boxes - target boxes|, averaged over images (logged, not trained)

With auxiliary decoding losses every decoder layer's prediction is matched and scored the same way (suffix
_i). The loss is the weighted sum (1, 5, 2 for ce, bbox, giou: DETR's). Equal to transformers' ImageLoss /
HungarianMatcher (tests/models/test_set_loss.py). The detector that uses it: qkv.models.detr.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.config import setting
from qkv.extras import require


def center_to_corners(b: Tensor) -> Tensor:
    """(..., 4) boxes (cx, cy, w, h) -> (x0, y0, x1, y1)."""
    cx, cy, w, h = b.unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)


def corners_to_center(b: Tensor) -> Tensor:
    x0, y0, x1, y1 = b.unbind(-1)
    return torch.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], dim=-1)


def box_iou(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """(N, 4), (M, 4) corner boxes -> IoU (N, M) and the union areas (N, M)."""
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    wh = (torch.min(a[:, None, 2:], b[:, 2:]) - torch.max(a[:, None, :2], b[:, :2])).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    union = area_a[:, None] + area_b - inter
    return inter / union, union


def generalized_box_iou(a: Tensor, b: Tensor) -> Tensor:
    """GIoU (Rezatofighi et al. 2019) of corner boxes, (N, M): IoU - (enclosing area - union) / enclosing
    area; in [-1, 1]. A box with x1 < x0 or y1 < y0 is a ValueError."""
    for name, x in (("a", a), ("b", b)):
        if not bool((x[:, 2:] >= x[:, :2]).all()):
            raise ValueError(f"boxes {name} must be corner boxes (x0, y0, x1, y1) with x1 >= x0 and y1 >= y0")
    iou, union = box_iou(a, b)
    wh = (torch.max(a[:, None, 2:], b[:, 2:]) - torch.min(a[:, None, :2], b[:, :2])).clamp(min=0)
    area = wh[..., 0] * wh[..., 1]
    return iou - (area - union) / area


@dataclass
class SetLossWeights:
    class_cost: float = setting(1.0, "matching cost of the class probability")
    bbox_cost: float = setting(5.0, "matching cost of the L1 box distance")
    giou_cost: float = setting(2.0, "matching cost of the generalised IoU")
    ce: float = setting(1.0, "loss weight of the cross-entropy")
    bbox: float = setting(5.0, "loss weight of the L1 box loss")
    giou: float = setting(2.0, "loss weight of the GIoU loss")
    eos_coef: float = setting(0.1, "weight of the no-object class in the cross-entropy")


@torch.no_grad()
def hungarian_match(logits: Tensor, boxes: Tensor, targets: list[dict[str, Tensor]],
                    w: SetLossWeights) -> list[tuple[Tensor, Tensor]]:
    """Per image, (prediction indices, target indices) of the minimum-cost one-to-one matching. logits
    (B, N, C + 1), boxes (B, N, 4) (cx, cy, w, h); targets[b]: "class_labels" (M_b,), "boxes" (M_b, 4)."""
    linear_sum_assignment = require("scipy.optimize", "DETR's Hungarian matching").linear_sum_assignment
    B, N = logits.shape[:2]
    prob = logits.flatten(0, 1).softmax(-1)
    out_box = boxes.flatten(0, 1)
    tgt_ids = torch.cat([t["class_labels"] for t in targets])
    tgt_box = torch.cat([t["boxes"] for t in targets])
    cost = (w.bbox_cost * torch.cdist(out_box, tgt_box, p=1) - w.class_cost * prob[:, tgt_ids]
            - w.giou_cost * generalized_box_iou(center_to_corners(out_box), center_to_corners(tgt_box)))
    big = torch.finfo(cost.dtype).max
    cost = torch.nan_to_num(cost, nan=big, posinf=big, neginf=big).view(B, N, -1).cpu()
    sizes = [len(t["boxes"]) for t in targets]
    out = []
    for b, c in enumerate(cost.split(sizes, -1)):
        i, j = linear_sum_assignment(c[b])
        out.append((torch.as_tensor(i, dtype=torch.int64), torch.as_tensor(j, dtype=torch.int64)))
    return out


def layer_losses(logits: Tensor, boxes: Tensor, targets: list[dict[str, Tensor]], w: SetLossWeights,
                 n_boxes: float) -> dict[str, Tensor]:
    """loss_ce, loss_bbox, loss_giou and cardinality_error of one decoder layer's predictions."""
    match = hungarian_match(logits, boxes, targets, w)
    batch_idx = torch.cat([torch.full_like(i, b) for b, (i, _) in enumerate(match)])
    pred_idx = torch.cat([i for i, _ in match])
    n_classes = logits.shape[-1] - 1
    classes = torch.full(logits.shape[:2], n_classes, dtype=torch.int64, device=logits.device)
    classes[batch_idx, pred_idx] = torch.cat([t["class_labels"][j] for t, (_, j) in zip(targets, match)])
    weight = torch.ones(n_classes + 1, device=logits.device)
    weight[-1] = w.eos_coef
    src = boxes[batch_idx, pred_idx]
    tgt = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, match)])
    giou = torch.diag(generalized_box_iou(center_to_corners(src), center_to_corners(tgt)))
    with torch.no_grad():
        lengths = torch.tensor([float(len(t["class_labels"])) for t in targets], device=logits.device)
        card = F.l1_loss((logits.argmax(-1) != n_classes).sum(1).float(), lengths)
    return {"loss_ce": F.cross_entropy(logits.transpose(1, 2), classes, weight),
            "loss_bbox": F.l1_loss(src, tgt, reduction="none").sum() / n_boxes,
            "loss_giou": (1 - giou).sum() / n_boxes, "cardinality_error": card}


def set_loss(logits: Tensor, boxes: Tensor, targets: list[dict[str, Tensor]], w: SetLossWeights | None = None,
             aux: list[tuple[Tensor, Tensor]] | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """(the weighted total, every term): the last layer's (logits, boxes) and, for auxiliary decoding losses,
    each earlier layer's (terms suffixed _0, _1, ...)."""
    w = w or SetLossWeights()
    if len(targets) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} images but {len(targets)} target sets")
    for k, t in enumerate(targets):
        if len(t["class_labels"]) != len(t["boxes"]):
            raise ValueError(f"target {k}: {len(t['class_labels'])} labels but {len(t['boxes'])} boxes")
    n_boxes = max(float(sum(len(t["class_labels"]) for t in targets)), 1.0)
    terms = layer_losses(logits, boxes, targets, w, n_boxes)
    for i, (lg, bx) in enumerate(aux or []):
        terms.update({f"{k}_{i}": v for k, v in layer_losses(lg, bx, targets, w, n_boxes).items()})
    weights = {"loss_ce": w.ce, "loss_bbox": w.bbox, "loss_giou": w.giou}

    def base(key: str) -> str:  # "loss_ce_1" -> "loss_ce"
        return key.rsplit("_", 1)[0] if key[-1].isdigit() else key

    total = sum(v * weights[base(k)] for k, v in terms.items() if base(k) in weights)
    return total, terms


__all__ = ["SetLossWeights", "box_iou", "center_to_corners", "corners_to_center", "generalized_box_iou",
           "hungarian_match", "set_loss"]
