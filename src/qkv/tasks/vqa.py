"""Visual question answering on Fashion-MNIST: templated questions about each image, answers from its label.

Every Fashion-MNIST image (Debian's dataset-fashion-mnist, or `path=` a folder with the four IDX files, labels
in Fashion-MNIST's class order) gets questions whose answers follow from its class alone:

  what      "what is it ?"            -> the class name ("sneaker", "ankle boot")               chance 1/10
  category  "which category is it ?"  -> clothing | footwear | bag                         majority 6/10
  yesno     "is it footwear ?" (or clothing, a bag; the true category half the time) -> yes | no     1/2
  describe  "describe it ."           -> "it is an ankle boot worn on the feet"                  1/10

The text is word-level over a fixed vocabulary built from the templates (a WordTokenizer), so an answer is a
short exact token sequence. One training row:

  <bos> <image> x N  what is it ?  <sep>  ankle boot <eos>
  `----------------- prompt -----------'  `-- answer --'    labels: -100 over the prompt, the answer's ids

N = (28 / patch_size)^2 placeholders, which the model replaces with its projected patch features
(models/vlm.py, class token dropped): the loss falls on the answer tokens and the <eos> ending them only.
Images, their order (seeded per-epoch permutations) and augmentation are the fashion_mnist task's.

Held out: the official test split (10,000 images). evaluate() asks every question type of each of its first n
images, generates greedily through model.generate (the image in the prefill), and scores an answer right when
the tokens generated up to <eos> are exactly the answer's: accuracy (all questions) and accuracy_<type>.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qkv.config import ConfigError, setting
from qkv.models.registry import family as family_spec
from qkv.tasks.base import Task, model_device, pad_rows, register_task, rng_for
from qkv.tasks.images import FASHION_DIR, FashionMNISTOptions, build_fashion_mnist
from qkv.tasks.options import check_option, check_options
from qkv.tasks.tokenizers import BOS, EOS, PAD, SEP, Tokenizer, WordTokenizer

CLASS_WORDS = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
               "ankle boot")
CATEGORY_OF = ("clothing", "clothing", "clothing", "clothing", "clothing", "footwear", "clothing", "footwear",
               "bag", "footwear")
CATEGORIES = ("clothing", "footwear", "bag")
ASKED = {"clothing": "clothing", "footwear": "footwear", "bag": "a bag"}  # how a yes/no question names each
WORN = {"clothing": "worn on the body", "footwear": "worn on the feet", "bag": "carried by hand"}
QUESTION_TYPES = ("what", "category", "yesno", "describe")
IMAGE = "<image>"  # the placeholder word; its id is the model's image_token_id


def question_answer(label: int, qtype: str, asked: str = "") -> tuple[str, str]:
    """(question, answer) of type `qtype` about an image of class `label`; asked: the category a yes/no
    question names."""
    name, category = CLASS_WORDS[label], CATEGORY_OF[label]
    if qtype == "what":
        return "what is it ?", name
    if qtype == "category":
        return "which category is it ?", category
    if qtype == "yesno":
        return f"is it {ASKED[asked]} ?", "yes" if asked == category else "no"
    if qtype == "describe":
        article = "an" if name[0] in "aeiou" else "a"
        return "describe it .", f"it is {article} {name} {WORN[category]}"
    raise ValueError(f"unknown question type {qtype!r}; known: {list(QUESTION_TYPES)}")


def asked_category(label: int, rng: random.Random) -> str:
    """The category a yes/no question names: the image's own half the time, else one of the other two, so
    "yes" and "no" are equally likely whatever the class."""
    own = CATEGORY_OF[label]
    return own if rng.random() < 0.5 else rng.choice([c for c in CATEGORIES if c != own])


def template_texts() -> list[str]:
    """Every question and answer the templates can produce (the vocabulary's source)."""
    return [text for label in range(len(CLASS_WORDS)) for qtype in QUESTION_TYPES for asked in CATEGORIES
            for text in question_answer(label, qtype, asked)]


@dataclass
class VQAOptions:
    path: str = setting(FASHION_DIR, "a folder with Fashion-MNIST's four IDX files")
    seed: int = setting(0, "seeds the training stream: image order, augmentation, question types")
    questions: list[str] = setting(list(QUESTION_TYPES), f"question types asked: {', '.join(QUESTION_TYPES)}")
    patch_size: int = setting(7, "the vision tower's patch side (7: 16 image tokens per prompt)", ge=1)
    pad: int = setting(0, "augmentation: random crop of the image padded by this many pixels", ge=0)
    hflip: bool = setting(True, "augmentation: horizontal flip with probability 1/2 (no answer needs a side)")

    def validate(self) -> None:
        check_options(self)
        bad = [q for q in self.questions if q not in QUESTION_TYPES]
        check_option(bool(self.questions) and not bad, "questions",
                     f": {bad or 'none'} - give one or more of {list(QUESTION_TYPES)}")


class VQATask(Task):
    kinds = ("decoder",)
    metrics = {"accuracy": "max", **{f"accuracy_{q}": "max" for q in QUESTION_TYPES}}

    def __init__(self, options: VQAOptions, family: str, tokenizer: Tokenizer | None = None) -> None:
        if not hasattr(family_spec(family).model_class, "image_features"):
            raise ConfigError(f"task 'vqa' needs a vision-language model family (llava), not {family!r}")
        self.options, self.family = options, family
        self.data = build_fashion_mnist(FashionMNISTOptions(options.path, options.seed, options.pad,
                                                            options.hflip), family)
        if len(self.data.classes) != len(CLASS_WORDS):
            raise ConfigError(f"{options.path}: {len(self.data.classes)} classes; the questions are about "
                              f"Fashion-MNIST's {len(CLASS_WORDS)}")
        size = self.data.image_size
        if size % options.patch_size:
            raise ConfigError(f"patch_size ({options.patch_size}) must divide the image size ({size})")
        self.tokenizer = tokenizer or WordTokenizer.from_text([*template_texts(), IMAGE])
        if IMAGE not in getattr(self.tokenizer, "stoi", {}):
            raise ConfigError(f"the tokenizer has no {IMAGE} placeholder word: not a vqa run's tokenizer")
        self.image_token_id = self.tokenizer.stoi[IMAGE]
        self.image_tokens = (size // options.patch_size) ** 2
        texts = [question_answer(y, q, c) for y in range(len(CLASS_WORDS)) for q in QUESTION_TYPES
                 for c in CATEGORIES]
        self.max_answer = max(len(a.split()) for _, a in texts) + 1  # + <eos>
        self.context_length = 2 + self.image_tokens + max(len(q.split()) for q, _ in texts) + self.max_answer

    # -- rows ------------------------------------------------------------------------------------------------
    def prompt_ids(self, question: str) -> list[int]:
        return [BOS, *[self.image_token_id] * self.image_tokens, *self.tokenizer.encode(question), SEP]

    def answer_ids(self, answer: str) -> list[int]:
        return [*self.tokenizer.encode(answer), EOS]

    def example(self, label: int, rng: random.Random) -> tuple[str, str, str]:
        """(question type, question, answer) drawn for an image of class `label`."""
        qtype = rng.choice(self.options.questions)
        asked = asked_category(label, rng) if qtype == "yesno" else ""
        return (qtype, *question_answer(label, qtype, asked))

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, Tensor]:
        """{"pixel_values": (B, 1, 28, 28), "input_ids": (B, T) prompt + answer, right-padded, "labels": the
        answer's ids (and its <eos>) where they stand in input_ids, -100 elsewhere}."""
        images = self.data.batch(index, batch_size, split)
        rng = rng_for(self.options.seed, split, index, "vqa")
        rows, targets = [], []
        for label in images["labels"].tolist():
            _, question, answer = self.example(label, rng)
            prompt, reply = self.prompt_ids(question), self.answer_ids(answer)
            rows.append(prompt + reply)
            targets.append([-100] * len(prompt) + reply)
        return {"pixel_values": images["pixel_values"], "input_ids": pad_rows(rows, PAD),
                "labels": pad_rows(targets, -100)}

    def model_overrides(self, family: str | None = None) -> dict[str, Any]:
        self._check_family(family)
        return {"vocab_size": self.tokenizer.vocab_size, "context_length": self.context_length,
                "image_size": self.data.image_size, "n_channels": int(self.data.images.shape[1]),
                "patch_size": self.options.patch_size, "image_token_id": self.image_token_id}

    def build_model(self, preset_or_config: Any, **overrides: Any) -> Any:
        """The model, checked to take as many image tokens per image as the prompts hold."""
        model = super().build_model(preset_or_config, **overrides)
        got = model.config.image_tokens
        if got != self.image_tokens:
            raise ConfigError(f"the model gives {got} image tokens per image, the task's prompts hold "
                              f"{self.image_tokens} (task.patch_size={self.options.patch_size}): set the "
                              "patch size with task.patch_size, and keep model.feature_select=default")
        return model

    # -- evaluation ------------------------------------------------------------------------------------------
    def eval_examples(self, n: int) -> list[tuple[int, str, str, str]]:
        """(image index, question type, question, answer): every asked type for each of the first n held-out
        images; the category a yes/no question names is fixed per image (seeded)."""
        out = []
        for i in self.data.val_idx[:n].tolist():
            label = int(self.data.labels[i])
            asked = asked_category(label, rng_for(self.options.seed, "val", i, "vqa-eval"))
            out += [(i, q, *question_answer(label, q, asked)) for q in self.options.questions]
        return out

    @torch.no_grad()
    def answer(self, model: torch.nn.Module, images: list[int], questions: list[str],
               batch_size: int = 256) -> list[list[int]]:
        """Greedy answers to questions about images (indices into the data), through model.generate with the
        image in the prefill: the token ids before <eos> (an answer that never ends gets a trailing -1, so it
        matches nothing). Prompts of one length go together, so no row is padded."""
        dev = model_device(model)
        groups: dict[int, list[int]] = defaultdict(list)
        prompts = [self.prompt_ids(q) for q in questions]
        for k, p in enumerate(prompts):
            groups[len(p)].append(k)
        out: list[list[int]] = [[] for _ in prompts]
        for ks in groups.values():
            for s in range(0, len(ks), batch_size):
                part = ks[s:s + batch_size]
                ids = torch.tensor([prompts[k] for k in part], device=dev)
                pixels = self.data.normalize(self.data.images[[images[k] for k in part]]).to(dev)
                seqs = model.generate(ids, pixel_values=pixels, max_new_tokens=self.max_answer,
                                      do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
                for k, row in zip(part, seqs[:, ids.shape[1]:].tolist()):
                    out[k] = row[:row.index(EOS)] if EOS in row else [*row, -1]
        return out

    def evaluate(self, model: torch.nn.Module, n: int = 500, batch_size: int = 256) -> dict[str, float]:
        """Exact-answer accuracy over every asked question type of the first n held-out images."""
        was = model.training
        model.eval()
        examples = self.eval_examples(n)
        got = self.answer(model, [e[0] for e in examples], [e[2] for e in examples], batch_size)
        model.train(was)
        hits: dict[str, list[bool]] = defaultdict(list)
        for (_, qtype, _, answer), ids in zip(examples, got):
            hits[qtype].append(ids == self.tokenizer.encode(answer))
        every = [h for q in hits for h in hits[q]]
        return {"accuracy": sum(every) / max(1, len(every)),
                **{f"accuracy_{q}": sum(h) / len(h) for q, h in hits.items()}, "n": float(len(every))}

    def generate_text(self, model: torch.nn.Module, prompt: str, *args: Any, **kwargs: Any) -> str:
        raise ConfigError("a vqa run answers questions about an image, and `qkv generate` takes text only: "
                          "`qkv eval RUN` asks every question about the test images (`eval.samples` in the "
                          "run config prints answers)")

    def samples(self, model: torch.nn.Module, n: int = 5) -> list[str]:
        """One question per held-out image (the types in turn), its greedy answer and the expected one."""
        k = len(self.options.questions)
        every = self.eval_examples(n)
        examples = [every[j * k + j % k] for j in range(len(every) // k)]
        was = model.training
        model.eval()
        got = self.answer(model, [e[0] for e in examples], [e[2] for e in examples])
        model.train(was)
        out = []
        for (i, _, question, answer), ids in zip(examples, got):
            said = self.tokenizer.decode([t for t in ids if t >= 0])
            verdict = "  (ok)" if ids == self.tokenizer.encode(answer) else f"  (expected: {answer})"
            name = CLASS_WORDS[int(self.data.labels[i])]
            out.append(f"test image {i} ({name}): {question} -> {said}{verdict}")
        return out


register_task("vqa", VQAOptions, VQATask, ("decoder",),
              "Fashion-MNIST questions and answers (what / category / yes-no / describe): a vision-language "
              "model trained from scratch", default_family="llava")
