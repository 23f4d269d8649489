"""Image-caption pairs for CLIP: scikit-learn's digits or Fashion-MNIST, with templated captions.

Every training image gets a caption from one of its dataset's training templates filled with its class's word
("a handwritten seven", "a grey picture of the ankle boot"); the model never sees a class id, only pairs.

  dataset: digits         scikit-learn's 8x8 digits, the digits task's fixed split (base "val" = test);
                          augmentation: a shift by up to `max_shift` pixels
  dataset: fashion_mnist  Fashion-MNIST's IDX files under `path` (the fashion_mnist task's reader; the split
                          "val" is the official 10,000-image test set), normalised by the training images'
                          mean and std; augmentation: a random crop of the image padded by `max_shift` pixels
                          and a horizontal flip (`hflip`), as the fashion_mnist task's

Batch: {"pixel_values": (B, 1, H, W), "input_ids": (B, T) word ids + <eos>, right-padded, "attention_mask"}.
Evaluation on the held-out images:
  zero_shot_accuracy  the class whose prompt from the dataset's zero-shot template ("a photo of the digit
                      seven", "a small picture of the sneaker": templates never used in training) is most
                      similar to the image
  recall@1 (i2t)      each test image is captioned (seeded, training templates); for every image, the most
                      similar of all test captions is a hit when it describes the image's class (templated
                      captions carry nothing else, so every caption of the right class is a correct match)
  recall@1 (t2i)      the same, from each test caption to the most similar test image

Batches: with `distinct_digits` (default; it applies to either dataset's ten classes), the classes of a batch
are drawn as consecutive random permutations of the ten, so a batch of <= 10 pairs never holds two images of
one class. InfoNCE treats every other caption in the batch as a negative; a second "seven" caption in the
batch would be a false negative.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from qkv.config import ConfigError, setting
from qkv.tasks.base import Task, check_split, model_device, pad_rows, register_task, rng_for
from qkv.tasks.digits import DIGIT_WORDS, load_digit_images, shift_images, stratified_split
from qkv.tasks.images import FASHION_DIR, FashionMNISTOptions, augment, build_fashion_mnist, hash_seed
from qkv.tasks.options import check_option, check_options
from qkv.tasks.tokenizers import EOS, PAD, Tokenizer, WordTokenizer
from qkv.tasks.vqa import CLASS_WORDS

TRAIN_TEMPLATES = (
    "a photo of a {}",
    "a handwritten {}",
    "an image of the number {}",
    "the digit {} written by hand",
    "a small scan of a {}",
    "{}",
)
ZERO_SHOT_TEMPLATE = "a photo of the digit {}"
# Fashion-MNIST's: the class name follows "the" (or stands alone), so "ankle boot" needs no "an"; the
# zero-shot prompt joins words of two training templates into a sentence never trained on
FASHION_TEMPLATES = (
    "a photo of the {}",
    "a grey picture of the {}",
    "an image showing the {}",
    "a small scan of the {}",
    "the {} from a shop catalogue",
    "{}",
)
FASHION_ZERO_SHOT = "a small picture of the {}"


@dataclass
class CaptionsOptions:
    seed: int = setting(0, "seeds the batch streams, the augmentation and the evaluation set")
    test_fraction: float = setting(0.2, "digits: share held out (fashion_mnist: its test set)", gt=0, lt=1)
    max_shift: int = setting(1, "augmentation: shift (digits) or crop of the padded image, in pixels", ge=0)
    distinct_digits: bool = setting(True, "batches of <= 10 pairs: distinct classes (no false negatives)")
    dataset: Literal["digits", "fashion_mnist"] = setting("digits", "the images")
    path: str = setting(FASHION_DIR, "fashion_mnist: a folder with the four IDX files")
    hflip: bool = setting(False, "fashion_mnist: horizontal flip with probability 1/2 (never for digits)")

    def validate(self) -> None:
        check_options(self)
        check_option(self.dataset != "digits" or (not self.hflip and self.path == FASHION_DIR), "dataset",
                     ": path and hflip are for dataset fashion_mnist, not digits")


@dataclass
class CaptionData:
    """What the task needs from a dataset: images, labels, the split, the class words and the templates."""

    images: Tensor  # (N, C, H, W): floats in [0, 1] (digits) or uint8, normalised per batch (fashion_mnist)
    labels: Tensor
    train_idx: Tensor
    test_idx: Tensor
    words: tuple[str, ...]
    templates: tuple[str, ...]
    zero_shot: str
    mean: float = 0.0
    std: float = 1.0


def digits_data(test_fraction: float) -> CaptionData:
    images, labels, _ = load_digit_images()
    train, test = stratified_split(labels, test_fraction)
    return CaptionData(torch.from_numpy(images).unsqueeze(1), torch.from_numpy(labels),
                       torch.from_numpy(train), torch.from_numpy(test), DIGIT_WORDS, TRAIN_TEMPLATES,
                       ZERO_SHOT_TEMPLATE)


def fashion_data(path: str, family: str) -> CaptionData:
    d = build_fashion_mnist(FashionMNISTOptions(path=path), family)
    if len(d.classes) != len(CLASS_WORDS):
        raise ConfigError(f"{path}: {len(d.classes)} classes; the captions name Fashion-MNIST's "
                          f"{len(CLASS_WORDS)}")
    return CaptionData(d.images, d.labels, d.train_idx, d.val_idx, CLASS_WORDS, FASHION_TEMPLATES,
                       FASHION_ZERO_SHOT, float(d.mean), float(d.std))


class CaptionsTask(Task):
    kinds = ("dual",)
    metrics = {"zero_shot_accuracy": "max", "recall@1_i2t": "max", "recall@1_t2i": "max"}

    def __init__(self, options: CaptionsOptions, family: str, tokenizer: Tokenizer | None = None) -> None:
        self.options, self.family = options, family
        if options.dataset == "digits":
            data = digits_data(options.test_fraction)
        else:
            data = fashion_data(options.path, family)
        self.data = data
        self.images, self.labels = data.images, data.labels
        self.train_idx, self.test_idx = data.train_idx, data.test_idx
        self.words, self.templates, self.zero_shot = data.words, data.templates, data.zero_shot
        self.by_class = {split: [idx[self.labels[idx] == c] for c in range(len(self.words))]
                         for split, idx in (("train", self.train_idx), ("val", self.test_idx))}
        texts = [t.format(w) for t in (*self.templates, self.zero_shot) for w in self.words]
        self.tokenizer = tokenizer or WordTokenizer.from_text(texts)
        self.max_tokens = max(len(t.split()) for t in texts) + 1  # + <eos>

    def pixels(self, idx: Tensor) -> Tensor:
        """The model's input for images `idx`: (B, C, H, W) floats."""
        x = self.images[idx]
        return x if x.is_floating_point() else (x.float() / 255 - self.data.mean) / self.data.std

    def caption(self, label: int, rng: random.Random) -> str:
        return rng.choice(self.templates).format(self.words[label])

    def encode_texts(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        rows = [self.tokenizer.encode(t) + [EOS] for t in texts]
        return pad_rows(rows, PAD), pad_rows([[1] * len(r) for r in rows], 0)

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, Tensor]:
        check_split(split)
        idx = self.train_idx if split == "train" else self.test_idx
        rng = rng_for(self.options.seed, split, index, "captions")
        if self.options.distinct_digits:
            by_class, k = self.by_class[split], len(self.words)
            classes: list[int] = []
            while len(classes) < batch_size:
                classes += rng.sample(range(k), k)
            pick = torch.tensor([int(by_class[c][rng.randrange(len(by_class[c]))])
                                     for c in classes[:batch_size]])
        else:
            pick = torch.tensor([idx[rng.randrange(len(idx))] for _ in range(batch_size)], dtype=torch.long)
        x = self.pixels(pick)
        if split == "train":
            x = self.augment(x, index, rng)
        ids, mask = self.encode_texts([self.caption(int(self.labels[i]), rng) for i in pick])
        return {"pixel_values": x, "input_ids": ids, "attention_mask": mask}

    def augment(self, x: Tensor, index: int, rng: random.Random) -> Tensor:
        """Training images shifted by up to max_shift pixels; fashion_mnist's as the fashion_mnist task's
        (random crop of the padded image, flip), seeded by (seed, index) apart from the caption stream."""
        s = self.options.max_shift
        if self.options.dataset == "fashion_mnist":
            gen = torch.Generator().manual_seed(hash_seed(self.options.seed, "augment", index))
            return augment(x, s, self.options.hflip, gen)
        if not s:
            return x
        return shift_images(x, torch.tensor([rng.randint(-s, s) for _ in x]),
                            torch.tensor([rng.randint(-s, s) for _ in x]))

    def model_overrides(self, family: str | None = None) -> dict[str, Any]:
        self._check_family(family)
        _, channels, _, size = self.images.shape
        return {"vocab_size": self.tokenizer.vocab_size, "context_length": self.max_tokens,
                "vision.image_size": int(size), "vision.n_channels": int(channels)}

    @torch.no_grad()
    def _embed_images(self, model: torch.nn.Module, idx: Tensor) -> Tensor:
        dev = model_device(model)
        return torch.cat([model.encode_image(self.pixels(idx[s:s + 256]).to(dev)).cpu()
                          for s in range(0, len(idx), 256)])

    @torch.no_grad()
    def _embed_texts(self, model: torch.nn.Module, texts: list[str]) -> Tensor:
        dev = model_device(model)
        out = []
        for s in range(0, len(texts), 1024):
            ids, mask = self.encode_texts(texts[s:s + 1024])
            out.append(model.encode_text(ids.to(dev), mask.to(dev)).cpu())
        return torch.cat(out)

    def evaluate(self, model: torch.nn.Module, n: int = 10_000, batch_size: int = 256) -> dict[str, float]:
        was = model.training
        model.eval()
        idx = self.test_idx[:n]
        img = self._embed_images(model, idx)
        prompts = self._embed_texts(model, [self.zero_shot.format(w) for w in self.words])
        zs = (img @ prompts.t()).argmax(-1)
        labels = self.labels[idx]
        rng = rng_for(self.options.seed, "val", 0, "captions-eval")
        caps = [self.caption(int(y), rng) for y in labels]
        txt = self._embed_texts(model, caps)
        i2t, t2i = recall_at_1(img, txt, labels)
        model.train(was)
        return {"zero_shot_accuracy": float((zs == labels).float().mean()), "recall@1_i2t": i2t,
                "recall@1_t2i": t2i, "n": float(len(idx))}

    def samples(self, model: torch.nn.Module, n: int = 5) -> list[str]:
        was = model.training
        model.eval()
        idx = self.test_idx[:n]
        prompts = [self.zero_shot.format(w) for w in self.words]
        sims = self._embed_images(model, idx) @ self._embed_texts(model, prompts).t()
        model.train(was)
        out = []
        for i, row in zip(idx.tolist(), sims):
            p = int(row.argmax())
            t = int(self.labels[i])
            out.append(f"test image {i} ({self.words[t]}): best prompt '{prompts[p]}'"
                       + ("  (ok)" if p == t else ""))
        return out


def recall_at_1(img: Tensor, txt: Tensor, labels: Tensor, chunk: int = 2048) -> tuple[float, float]:
    """Image->text and text->image recall@1 of paired embeddings (row i of each belongs to image i), a hit
    when the best match has the same label. The (images, captions) similarities go in blocks of `chunk`
    rows or columns: all 10,000 x 10,000 at once would take 400 MB."""
    best_txt = torch.cat([(img[s:s + chunk] @ txt.t()).argmax(1) for s in range(0, len(img), chunk)])
    best_img = torch.cat([(img @ txt[s:s + chunk].t()).argmax(0) for s in range(0, len(txt), chunk)])
    return (float((labels[best_txt] == labels).float().mean()),
            float((labels[best_img] == labels).float().mean()))


register_task("captions", CaptionsOptions, CaptionsTask, ("dual",),
              "digits or Fashion-MNIST (dataset=) with templated captions: image-text pairs for CLIP "
              "(zero-shot + retrieval evaluation)",
              default_family="clip")
