"""COCO box mAP through pycocotools (the COCO team's own evaluator): mAP over IoU thresholds 0.50:0.05:0.95,
AP at IoU 0.50 and 0.75, 101-point interpolated precision, up to 100 detections per image.

    coco_map(targets, detections) -> {"map": ..., "map_50": ..., "map_75": ...}

targets[i] = (boxes (M, 4), labels (M,)) and detections[i] = (boxes (K, 4), scores (K,), labels (K,)) of
image i, boxes (x0, y0, x1, y1) in pixels. Categories with no target box are left out of the mean (COCO's
rule); an evaluation without any target box is a ValueError (mAP is undefined there).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence

import numpy as np
from torch import Tensor

from qkv.extras import require

ArrayLike = np.ndarray | Tensor


def to_xywh(boxes: ArrayLike) -> list[list[float]]:
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    return np.concatenate([b[:, :2], b[:, 2:] - b[:, :2]], axis=1).tolist()


def coco_map(targets: Sequence[tuple[ArrayLike, ArrayLike]],
             detections: Sequence[tuple[ArrayLike, ArrayLike, ArrayLike]]) -> dict[str, float]:
    """COCO's box mAP, AP50 and AP75 of `detections` against `targets` (see the module docstring)."""
    if len(targets) != len(detections):
        raise ValueError(f"{len(targets)} target sets but {len(detections)} detection sets")
    coco_mod = require("pycocotools.coco", "COCO mAP")
    cocoeval_mod = require("pycocotools.cocoeval", "COCO mAP")
    annotations, results, classes = [], [], set()
    for image_id, ((boxes, labels), (dboxes, scores, dlabels)) in enumerate(zip(targets, detections)):
        for box, label in zip(to_xywh(boxes), np.asarray(labels).reshape(-1).tolist()):
            # ids from 1: pycocotools takes a matched id of 0 for "unmatched"
            annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                "category_id": int(label) + 1, "bbox": box, "area": box[2] * box[3],
                                "iscrowd": 0})
            classes.add(int(label) + 1)
        for box, score, label in zip(to_xywh(dboxes), np.asarray(scores).reshape(-1).tolist(),
                                     np.asarray(dlabels).reshape(-1).tolist()):
            results.append({"image_id": image_id, "category_id": int(label) + 1, "bbox": box,
                            "score": float(score)})
    if not annotations:
        raise ValueError("COCO mAP needs at least one target box; these images have none")
    if not results:  # nothing detected: every AP is 0 (pycocotools' loadRes cannot take an empty list)
        return {"map": 0.0, "map_50": 0.0, "map_75": 0.0}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress and the table
        gt = coco_mod.COCO()
        classes |= {r["category_id"] for r in results}
        gt.dataset = {"images": [{"id": i} for i in range(len(targets))], "annotations": annotations,
                      "categories": [{"id": c} for c in sorted(classes)]}
        gt.createIndex()
        ev = cocoeval_mod.COCOeval(gt, gt.loadRes(results), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return {"map": float(ev.stats[0]), "map_50": float(ev.stats[1]), "map_75": float(ev.stats[2])}
