"""Image-caption pairs for CLIP: scikit-learn's handwritten digits with templated captions.

Every training image gets a caption from one of `TRAIN_TEMPLATES` filled with its digit's word ("a handwritten
seven"); the model never sees a class id, only pairs. Same fixed split as the digits task (base "val" = test).

Batch: {"pixel_values": (B, 1, 8, 8), "input_ids": (B, T) word ids + <eos>, right-padded, "attention_mask"}.
Evaluation on the held-out images:
  zero_shot_accuracy  the class whose prompt ZERO_SHOT_TEMPLATE ("a photo of the digit seven", a template
                      never used in training) is most similar to the image
  recall@1 (i2t)      each test image is captioned (seeded, training templates); for every image, the most
                      similar of all test captions is a hit when it describes the image's digit (templated
                      captions carry nothing else, so every caption of the right digit is a correct match)
  recall@1 (t2i)      the same, from each test caption to the most similar test image

Batches: with `distinct_digits` (default), the digits of a batch are drawn as consecutive random permutations
of the ten classes, so a batch of <= 10 pairs never holds two images of one digit. InfoNCE treats every other
caption in the batch as a negative; a second "seven" caption in the batch would be a false negative.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qkv.config import ConfigError
from qkv.tasks.base import Task, check_split, model_device, pad_rows, register_task, rng_for
from qkv.tasks.digits import DIGIT_WORDS, load_digit_images, shift_images, stratified_split
from qkv.tasks.tokenizers import EOS, PAD, Tokenizer, WordTokenizer

TRAIN_TEMPLATES = (
    "a photo of a {}",
    "a handwritten {}",
    "an image of the number {}",
    "the digit {} written by hand",
    "a small scan of a {}",
    "{}",
)
ZERO_SHOT_TEMPLATE = "a photo of the digit {}"


@dataclass
class CaptionsOptions:
    seed: int = 0
    test_fraction: float = 0.2
    max_shift: int = 1
    distinct_digits: bool = True  # batches of <= 10 pairs hold ten different digits (no false negatives)

    def validate(self) -> None:
        if not 0.0 < self.test_fraction < 1.0:
            raise ConfigError(f"test_fraction must be in (0, 1), got {self.test_fraction}")


class CaptionsTask(Task):
    kinds = ("dual",)
    metrics = {"zero_shot_accuracy": "max", "recall@1_i2t": "max", "recall@1_t2i": "max"}

    def __init__(self, options: CaptionsOptions, family: str, tokenizer: Tokenizer | None = None) -> None:
        self.options, self.family = options, family
        images, labels, _ = load_digit_images()
        self.images, self.labels = torch.from_numpy(images).unsqueeze(1), torch.from_numpy(labels)
        self.train_idx, self.test_idx = (torch.from_numpy(i)
                                             for i in stratified_split(labels, options.test_fraction))
        texts = [t.format(w) for t in (*TRAIN_TEMPLATES, ZERO_SHOT_TEMPLATE) for w in DIGIT_WORDS]
        self.tokenizer = tokenizer or WordTokenizer.from_text(texts)
        self.max_tokens = max(len(t.split()) for t in texts) + 1  # + <eos>

    def caption(self, label: int, rng) -> str:
        return rng.choice(TRAIN_TEMPLATES).format(DIGIT_WORDS[label])

    def encode_texts(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        rows = [self.tokenizer.encode(t) + [EOS] for t in texts]
        return pad_rows(rows, PAD), pad_rows([[1] * len(r) for r in rows], 0)

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, Tensor]:
        check_split(split)
        idx = self.train_idx if split == "train" else self.test_idx
        rng = rng_for(self.options.seed, split, index, "captions")
        if self.options.distinct_digits:
            by_class = [idx[self.labels[idx] == c] for c in range(10)]
            classes: list[int] = []
            while len(classes) < batch_size:
                classes += rng.sample(range(10), 10)
            pick = torch.tensor([int(by_class[c][rng.randrange(len(by_class[c]))])
                                     for c in classes[:batch_size]])
        else:
            pick = torch.tensor([idx[rng.randrange(len(idx))] for _ in range(batch_size)], dtype=torch.long)
        x = self.images[pick]
        if split == "train" and self.options.max_shift:
            s = self.options.max_shift
            x = shift_images(x, torch.tensor([rng.randint(-s, s) for _ in pick]),
                             torch.tensor([rng.randint(-s, s) for _ in pick]))
        ids, mask = self.encode_texts([self.caption(int(self.labels[i]), rng) for i in pick])
        return {"pixel_values": x, "input_ids": ids, "attention_mask": mask}

    def model_overrides(self, family: str | None = None) -> dict[str, Any]:
        self._check_family(family)
        return {"vocab_size": self.tokenizer.vocab_size, "context_length": self.max_tokens,
                "vision.image_size": 8, "vision.n_channels": 1}

    @torch.no_grad()
    def _embed_images(self, model: torch.nn.Module, idx: Tensor) -> Tensor:
        dev = model_device(model)
        return torch.cat([model.encode_image(self.images[idx[s:s + 256]].to(dev)).cpu()
                          for s in range(0, len(idx), 256)])

    @torch.no_grad()
    def _embed_texts(self, model: torch.nn.Module, texts: list[str]) -> Tensor:
        dev = model_device(model)
        ids, mask = self.encode_texts(texts)
        return model.encode_text(ids.to(dev), mask.to(dev)).cpu()

    def evaluate(self, model: torch.nn.Module, n: int = 10_000, batch_size: int = 256) -> dict[str, float]:
        was = model.training
        model.eval()
        idx = self.test_idx[:n]
        img = self._embed_images(model, idx)
        prompts = self._embed_texts(model, [ZERO_SHOT_TEMPLATE.format(w) for w in DIGIT_WORDS])
        zs = (img @ prompts.t()).argmax(-1)
        labels = self.labels[idx]
        rng = rng_for(self.options.seed, "val", 0, "captions-eval")
        caps = [self.caption(int(y), rng) for y in labels]
        txt = self._embed_texts(model, caps)
        sims = img @ txt.t()  # (images, captions); caption i belongs to image i
        i2t = (labels[sims.argmax(1)] == labels).float().mean()
        t2i = (labels[sims.argmax(0)] == labels).float().mean()
        model.train(was)
        return {"zero_shot_accuracy": float((zs == labels).float().mean()), "recall@1_i2t": float(i2t),
                "recall@1_t2i": float(t2i), "n": float(len(idx))}

    def samples(self, model: torch.nn.Module, n: int = 5) -> list[str]:
        was = model.training
        model.eval()
        idx = self.test_idx[:n]
        prompts = [ZERO_SHOT_TEMPLATE.format(w) for w in DIGIT_WORDS]
        sims = self._embed_images(model, idx) @ self._embed_texts(model, prompts).t()
        model.train(was)
        out = []
        for i, row in zip(idx.tolist(), sims):
            p = int(row.argmax())
            t = int(self.labels[i])
            out.append(f"test image {i} ({DIGIT_WORDS[t]}): best prompt '{prompts[p]}'"
                       + ("  (ok)" if p == t else ""))
        return out


register_task("captions", CaptionsOptions, CaptionsTask, ("dual",),
              "digits with templated captions: image-text pairs for CLIP (zero-shot + retrieval evaluation)",
              default_family="clip")
