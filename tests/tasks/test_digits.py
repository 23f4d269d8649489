"""Digits task (ViT/Swin) and captions task (CLIP): fixed disjoint stratified split, deterministic batches,
augmentations against torch references, image folders, evaluation plumbing."""

import numpy as np
import pytest
import torch

from qkv.config import ConfigError
from qkv.tasks import build_task
from qkv.tasks.captions import TRAIN_TEMPLATES, ZERO_SHOT_TEMPLATE
from qkv.tasks.digits import DIGIT_WORDS, rotate_scale, shift_images, stratified_split


def test_split_is_fixed_disjoint_and_stratified():
    task = build_task("digits", family="vit")
    tr, te = set(task.train_idx.tolist()), set(task.test_idx.tolist())
    assert not tr & te and len(tr) + len(te) == 1797
    assert len(te) == sum(int(np.ceil(0.2 * int((task.labels == c).sum()))) for c in range(10))
    again = build_task("digits", family="swin", seed=5)  # the task seed changes batches, not the split
    assert torch.equal(again.test_idx, task.test_idx)
    labels = np.array([0] * 10 + [1] * 5)
    a, b = stratified_split(labels, 0.2)
    assert sorted(labels[b].tolist()) == [0, 0, 1]


def test_batches_are_deterministic_and_shaped():
    task = build_task("digits", family="vit", max_rotate=10.0, max_scale=0.1)
    b1, b2 = task.batch(3, 16), task.batch(3, 16)
    assert b1["pixel_values"].shape == (16, 1, 8, 8) and b1["labels"].shape == (16,)
    assert torch.equal(b1["pixel_values"], b2["pixel_values"]) and torch.equal(b1["labels"], b2["labels"])
    assert not torch.equal(task.batch(4, 16)["labels"], b1["labels"])
    val = task.batch(0, 32, "val")
    assert float(val["pixel_values"].max()) <= 1.0
    assert task.model_overrides() == {"image_size": 8, "n_channels": 1, "num_labels": 10}
    with pytest.raises(ValueError, match="split"):
        task.batch(0, 4, "test")
    with pytest.raises(ConfigError, match="families|support"):
        build_task("digits", family="gpt")


def test_augmentations_against_torch_references():
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(rotate_scale(x, torch.zeros(2), torch.ones(2)), x, atol=1e-6, rtol=0)
    torch.testing.assert_close(rotate_scale(x, torch.full((2,), 90.0), torch.ones(2)),
                               torch.rot90(x, 1, (2, 3)), atol=1e-5, rtol=0)
    s = shift_images(x, torch.tensor([1, 0]), torch.tensor([0, -2]))
    torch.testing.assert_close(s[0, :, 1:], x[0, :, :-1])
    assert s[0, :, 0].abs().sum() == 0
    torch.testing.assert_close(s[1, :, :, :-2], x[1, :, :, 2:])


def test_image_folder(tmp_path):
    import matplotlib.image as mpimg

    rng = np.random.default_rng(0)
    for name in ("cat", "dog"):
        (tmp_path / name).mkdir()
        for i in range(5):
            mpimg.imsave(tmp_path / name / f"{i}.png", rng.random((4, 4)), cmap="gray")
    task = build_task("digits", family="vit", image_folder=str(tmp_path))
    assert task.classes == ["cat", "dog"] and task.images.shape == (10, 1, 4, 4)
    assert task.model_overrides()["num_labels"] == 2
    mpimg.imsave(tmp_path / "dog" / "big.png", rng.random((6, 6)), cmap="gray")
    with pytest.raises(ConfigError, match="one size"):
        build_task("digits", family="vit", image_folder=str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist"):
        build_task("digits", family="vit", image_folder=str(tmp_path / "nope"))


def test_digits_evaluate_counts_correct_predictions():
    task = build_task("digits", family="vit")

    class Oracle(torch.nn.Module):  # predicts the label of the matching training image: exact on test images
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, pixel_values):
            flat = task.images.flatten(1)
            idx = torch.cdist(pixel_values.flatten(1), flat).argmin(1)
            from qkv.models.base import ModelOutput

            return ModelOutput(logits=torch.nn.functional.one_hot(task.labels[idx], 10).float())

    m = task.evaluate(Oracle())
    assert m["accuracy"] == 1.0 and m["n"] == len(task.test_idx)
    assert all("(ok)" in s for s in task.samples(Oracle(), 3))


def test_captions_batches_and_templates():
    task = build_task("captions", family="clip", max_shift=0)
    b = task.batch(0, 10)
    assert b["pixel_values"].shape == (10, 1, 8, 8)
    assert ZERO_SHOT_TEMPLATE not in TRAIN_TEMPLATES
    named = []
    for x, row, mask in zip(b["pixel_values"], b["input_ids"], b["attention_mask"]):
        text = task.tokenizer.decode(row[mask.bool()])
        assert any(text == t.format(w) for t in TRAIN_TEMPLATES for w in DIGIT_WORDS), text
        word = next(w for w in DIGIT_WORDS if w in text.split())
        named.append(word)
        # the caption names the digit of its image (found in the dataset by exact pixel match)
        match = (task.images.flatten(1) == x.flatten()).all(1).nonzero()[0, 0]
        assert DIGIT_WORDS[int(task.labels[match])] == word
    assert sorted(named) == sorted(DIGIT_WORDS)  # distinct_digits: ten different digits per batch
    ov = task.model_overrides()
    model = task.build_model("clip-digits", **{"n_layers": 1, "vision.n_layers": 1})
    assert model.config.vocab_size == ov["vocab_size"] and model.config.vision.image_size == 8
    m = task.evaluate(model, n=40)
    assert 0.0 <= m["zero_shot_accuracy"] <= 1.0 and 0.0 <= m["recall@1_i2t"] <= 1.0 and m["n"] == 40
    assert 0.0 <= m["recall@1_t2i"] <= 1.0
