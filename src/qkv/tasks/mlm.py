"""Masked-language-model pretraining (BERT's cloze task, Devlin et al. 2019 §3.1) on a text file.

    mask_tokens: 15% of the maskable tokens are chosen (each on its own, or whole words at a time); of those
    80% become [MASK], 10% a random token, 10% stay as they are; the labels are the original ids at the chosen
    positions and -100 elsewhere (only they are predicted). Special tokens and padding are never chosen.

`task: mlm` (qkv train) trains an encoder (family bert) from scratch: the text's lines are tokenized (char or
byte-level BPE, as the LM tasks), packed into windows of `context` tokens (<bos> ... <eos>), and masked afresh
for every batch from (seed, split, batch index), so a resumed run sees the same masks. Evaluation masks the
validation windows with fixed seeds and reports the masked-token loss, its perplexity and accuracy.
`qkv finetune --task mlm` (qkv.finetune.mlm) uses mask_tokens on a Hugging Face folder's tokenizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from qkv.config import ConfigError, setting
from qkv.tasks.base import (
    Task,
    check_split,
    model_device,
    read_text_file,
    register_task,
    text_sha256,
)
from qkv.tasks.options import check_option, check_options
from qkv.tasks.tokenizers import BOS, EOS, MASK, PAD, SPECIALS, BPETokenizer, CharTokenizer, Tokenizer


@dataclass
class MaskingRule:
    """BERT's masking: `rate` of the maskable tokens chosen; of those, `mask_share` -> [MASK], `random_share`
    -> a random token, the rest unchanged."""

    rate: float = 0.15
    mask_share: float = 0.8
    random_share: float = 0.1
    whole_word: bool = False  # choose words (every token of a chosen word), as BERT's whole-word masking

    def validate(self) -> None:
        if not 0.0 < self.rate < 1.0:
            raise ConfigError(f"mask rate must be in (0, 1), got {self.rate}")
        if self.mask_share < 0 or self.random_share < 0 or self.mask_share + self.random_share > 1:
            raise ConfigError(f"mask_share ({self.mask_share}) and random_share ({self.random_share}) must "
                              "be >= 0 and sum to at most 1")


def mask_tokens(ids: Tensor, maskable: Tensor, rule: MaskingRule, mask_id: int, vocab_size: int,
                generator: torch.Generator, word_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(input_ids, labels) for ids (B, T): maskable (B, T) bool marks the tokens that may be chosen; word_ids
    (B, T) numbers each token's word (whole-word masking: a word is chosen or not as one, -1 = no word)."""
    if rule.whole_word:
        if word_ids is None:
            raise ValueError("whole-word masking needs word_ids")
        n_words = int(word_ids.max()) + 1 if word_ids.numel() else 0
        pick = torch.rand((ids.shape[0], max(n_words, 1)), generator=generator) < rule.rate
        chosen = pick.gather(1, word_ids.clamp_min(0)) & (word_ids >= 0)
    else:
        chosen = torch.rand(ids.shape, generator=generator) < rule.rate
    chosen &= maskable
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    u = torch.rand(ids.shape, generator=generator)
    to_mask = chosen & (u < rule.mask_share)
    to_random = chosen & (u >= rule.mask_share) & (u < rule.mask_share + rule.random_share)
    out = ids.clone()
    out[to_mask] = mask_id
    out[to_random] = torch.randint(vocab_size, ids.shape, generator=generator)[to_random]
    return out, labels


def word_ids_from_starts(starts: Tensor, maskable: Tensor) -> Tensor:
    """(B, T) word numbers from (B, T) word-start flags: a token continues the word before it unless it
    starts one; non-maskable tokens belong to no word (-1)."""
    n = torch.cumsum((starts | ~maskable).long(), dim=1) - 1
    return torch.where(maskable, n, torch.full_like(n, -1))


def generator_for(seed: int, split: str, index: int) -> torch.Generator:
    salt = {"train": 0, "val": 1, "test": 2}[split]
    return torch.Generator().manual_seed((seed * 1_000_003 + salt * 7_919 + index) % (2**63))


@torch.no_grad()
def masked_lm_scores(model: torch.nn.Module, batches: list[dict[str, Tensor]]) -> dict[str, float]:
    """Masked-token loss (mean over the chosen tokens), perplexity and accuracy over `batches`."""
    was = model.training
    model.eval()
    device = model_device(model)
    total = correct = 0
    loss_sum = 0.0
    try:
        for b in batches:
            b = {k: v.to(device) for k, v in b.items()}
            logits = model(**{k: v for k, v in b.items() if k != "labels"}).logits.float()
            sel = b["labels"] != -100
            if not bool(sel.any()):
                continue
            gold = b["labels"][sel]
            loss_sum += float(torch.nn.functional.cross_entropy(logits[sel], gold, reduction="sum"))
            correct += int((logits[sel].argmax(-1) == b["labels"][sel]).sum())
            total += int(sel.sum())
    finally:
        model.train(was)
    if total == 0:
        raise ConfigError("no token was masked in the evaluation data: it is too small")
    loss = loss_sum / total
    return {"mlm_loss": loss, "perplexity": math.exp(min(loss, 50.0)), "mlm_accuracy": correct / total}


@dataclass
class MLMOptions:
    path: str = setting("", "UTF-8 text file (one document or sentence per line, or running text); required")
    tokenizer: Literal["char", "bpe"] = setting("char", "char, or bpe (byte-level BPE of the train split)")
    bpe_vocab_size: int = setting(1024, "BPE vocabulary, specials and the 256 bytes included")
    context: int = setting(64, "tokens per window, <bos> and <eos> included (the model's context)", ge=4)
    mask_rate: float = setting(0.15, "share of the tokens chosen for prediction", gt=0, lt=1)
    mask_share: float = setting(0.8, "share of the chosen tokens replaced by the mask token", ge=0)
    random_share: float = setting(0.1, "share of the chosen tokens replaced by a random token", ge=0)
    whole_word: bool = setting(False, "choose whole words (every token of a chosen word)")
    val_fraction: float = setting(0.1, "last share of the text held out", gt=0, lt=1)
    seed: int = setting(0, "seeds the masks")

    def validate(self) -> None:
        check_options(self)
        check_option(bool(self.path), "path", "is required: a text file")
        check_option(self.mask_share + self.random_share <= 1, "random_share",
                     f"must be at most 1 - mask_share ({1 - self.mask_share:g}), got {self.random_share}")

    @property
    def rule(self) -> MaskingRule:
        return MaskingRule(self.mask_rate, self.mask_share, self.random_share, self.whole_word)


class MLMTask(Task):
    name = "mlm"
    kinds = ("encoder",)
    metrics = {"mlm_loss": "min", "perplexity": "min", "mlm_accuracy": "max"}

    def __init__(self, options: MLMOptions, family: str, tokenizer: Tokenizer | None = None) -> None:
        self.options = o = options
        self.family = family
        o.path = str(Path(o.path).expanduser().resolve())
        text = read_text_file(o.path)
        self.data_sha256 = text_sha256(text)
        cut = int(len(text) * (1 - o.val_fraction))
        train_text, val_text = text[:cut], text[cut:]
        if tokenizer is None:
            tokenizer = (CharTokenizer.from_text(text) if o.tokenizer == "char"
                         else BPETokenizer.train([train_text], vocab_size=o.bpe_vocab_size))
        self.tokenizer = tokenizer
        self.windows = {"train": self._windows(train_text), "val": self._windows(val_text)}
        for split, w in self.windows.items():
            if len(w) == 0:
                raise ConfigError(f"{o.path}: the {split} split holds no window of text; use a longer text")

    def _windows(self, text: str) -> list[tuple[Tensor, Tensor]]:
        """(ids, word starts) of windows of context - 2 tokens (+ <bos>, <eos>) over the text's tokens."""
        ids = self.tokenizer.encode(text)
        pieces = [self.tokenizer.decode([i]) for i in range(self.tokenizer.vocab_size)]
        n = self.options.context - 2
        out = []
        for s in range(0, len(ids) - n // 2, n):
            chunk = ids[s:s + n]
            starts = [k == 0 or not pieces[t][:1].strip() or not pieces[chunk[k - 1]][-1:].strip()
                      for k, t in enumerate(chunk)]
            out.append((torch.tensor([BOS, *chunk, EOS]), torch.tensor([True, *starts, True])))
        return out

    def rows(self, windows: list[tuple[Tensor, Tensor]], gen: torch.Generator) -> dict[str, Tensor]:
        T = max(len(w[0]) for w in windows)
        ids = torch.full((len(windows), T), PAD)
        starts = torch.ones((len(windows), T), dtype=torch.bool)
        for r, (w, st) in enumerate(windows):
            ids[r, :len(w)], starts[r, :len(w)] = w, st
        maskable = ids >= len(SPECIALS)
        inp, labels = mask_tokens(ids, maskable, self.options.rule, MASK, self.tokenizer.vocab_size, gen,
                                  word_ids_from_starts(starts, maskable))
        return {"input_ids": inp, "attention_mask": (ids != PAD).long(), "labels": labels}

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, Tensor]:
        check_split(split)
        gen = generator_for(self.options.seed, split, index)
        w = self.windows[split]
        pick = torch.randint(len(w), (batch_size,), generator=gen).tolist()
        return self.rows([w[i] for i in pick], gen)

    def model_overrides(self, family: str | None = None) -> dict[str, Any]:
        self._check_family(family)
        return {"vocab_size": self.tokenizer.vocab_size, "context_length": self.options.context,
                "head": "mlm", "pad_token_id": PAD}

    def evaluate(self, model: torch.nn.Module, n: int | None = None,
                 batch_size: int = 64) -> dict[str, float]:
        w = self.windows["val"][:n] if n else self.windows["val"]
        batches = [self.rows(w[s:s + batch_size], generator_for(self.options.seed, "val", s))
                   for s in range(0, len(w), batch_size)]
        return masked_lm_scores(model, batches)

    def samples(self, model: torch.nn.Module, n: int = 3) -> list[str]:
        """Validation windows with their masked tokens filled by the model (greedy)."""
        b = self.rows(self.windows["val"][:n], generator_for(self.options.seed, "val", 0))
        with torch.no_grad():
            logits = model(**{k: v.to(model_device(model)) for k, v in b.items() if k != "labels"}).logits
        filled = torch.where(b["labels"] != -100, logits.argmax(-1).cpu(), b["input_ids"])
        return [self.tokenizer.decode([t for t in row.tolist() if t >= len(SPECIALS)]) for row in filled]

    def generate_text(self, model: torch.nn.Module, prompt: str, *args: Any, **kwargs: Any) -> str:
        """The prompt with each "<mask>" in it filled by the model's most likely token (generation settings
        do not apply: one forward pass)."""
        pieces = [self.tokenizer.encode(part) for part in prompt.split("<mask>")]
        body = [t for k, part in enumerate(pieces) for t in ([MASK] if k else []) + part]
        ids = torch.tensor([[BOS, *body, EOS]])
        with torch.no_grad():
            logits = model(ids.to(model_device(model))).logits[0].cpu()
        out = torch.where(ids[0] == MASK, logits.argmax(-1), ids[0])
        return self.tokenizer.decode([t for t in out.tolist() if t >= len(SPECIALS)])


def _factory(options: MLMOptions, family: str, tokenizer: Tokenizer | None = None) -> Task:
    return MLMTask(options, family, tokenizer)


register_task("mlm", MLMOptions, _factory, ("encoder",),
              "masked-LM pretraining (BERT's 15%, 80/10/10, optional whole words) on a text file",
              default_family="bert")
