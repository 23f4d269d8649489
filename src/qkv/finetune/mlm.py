"""`qkv finetune DIR --task mlm`: masked-LM training (domain adaptation) of a BERT / RoBERTa / XLM-R /
DistilBERT / DeBERTa-v2/v3 folder on a text file.

    qkv finetune bert-folder --task mlm --data corpus.txt [--dev held_out.txt] --out adapted [--epochs 3]
        [--mask-rate 0.15] [--whole-word] [train.lr=5e-5]

Data: one text per non-empty line (a sentence, a paragraph, a document), tokenized by the folder's tokenizer
with its special tokens and cut at the model's context (counted in the report). Each batch is masked afresh by
BERT's rule (qkv.tasks.mlm.mask_tokens: 15% of the non-special tokens, 80% -> the folder's mask token, 10% a
random token, 10% unchanged), from (seed, batch index): a resumed run masks as the first one did. With
--whole-word every token of a chosen word is chosen with it (the tokenizer's word ids: WordPiece's ##
continuations, BPE's and SentencePiece's word starts). A folder with an MLM head keeps it; one without gets a
new head (its decoder tied to the word embeddings). With --dev: the masked-token loss, perplexity and accuracy
each epoch on fixed masks, the best checkpoint kept. OUT is a Hugging Face *ForMaskedLM folder (transformers'
AutoModelForMaskedLM; `qkv predict OUT --text "... [MASK] ..."`; qkv.from_pretrained) with the source's
tokenizer files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.config import ConfigError, setting
from qkv.finetune.encoders import EncodedData, EncoderFolder, encode, new_head_model, pad_batch
from qkv.finetune.phases import EncoderRecipe
from qkv.finetune.registry import Recipe, register_recipe
from qkv.finetune.settings import FinetuneSettings
from qkv.tasks.base import text_lines
from qkv.tasks.mlm import MaskingRule, generator_for, mask_tokens, masked_lm_scores

METRICS = {"mlm_loss": "min", "perplexity": "min", "mlm_accuracy": "max"}
MASK_NAMES = ("[MASK]", "<mask>")


@dataclass(kw_only=True)
class MLMSettings(FinetuneSettings):
    RECIPE = "mlm"

    mask_rate: float = setting(0.15, "share of the tokens chosen for prediction")
    whole_word: bool = setting(False, "choose whole words (every token of a chosen word)")

    def __post_init__(self) -> None:
        super().__post_init__()
        MaskingRule(rate=float(self.mask_rate), whole_word=bool(self.whole_word)).validate()


def mask_id(enc: EncoderFolder) -> int:
    """The folder's mask token id (tokenizer_config.json's mask_token, else [MASK] / <mask>)."""
    path = enc.path / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    named = cfg.get("mask_token")
    named = named.get("content") if isinstance(named, dict) else named
    for name in ([named] if isinstance(named, str) else []) + list(MASK_NAMES):
        i = enc.tokenizer.token_to_id(name)
        if i is not None:
            return int(i)
    raise ConfigError(f"{enc.path}: its tokenizer has no mask token ({' or '.join(MASK_NAMES)})")


def read_texts(path: str | Path) -> list[str]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: no such text file")
    try:
        texts = [line for line in text_lines(p.read_text(encoding="utf-8")) if line.strip()]
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e})") from None
    if not texts:
        raise ConfigError(f"{path}: no text (every line is empty)")
    return texts


class MaskedData(EncodedData):
    """Encoded texts whose batches are masked by `rule`, from (seed, split, index)."""

    def __init__(self, encodings: list[Any], pad_id: int, seed: int, rule: MaskingRule, mask: int,
                 vocab_size: int, token_types: bool) -> None:
        super().__init__(encodings, [0] * len(encodings), pad_id, seed, METRICS, token_types)
        self.rule, self.mask, self.vocab_size = rule, mask, vocab_size

    def masked(self, idx: list[int], gen: torch.Generator) -> dict[str, Tensor]:
        encs = [self.encodings[i] for i in idx]
        ids = pad_batch([e.ids for e in encs], self.pad_id)
        keep = pad_batch([e.attention_mask for e in encs], 0)
        special = pad_batch([e.special_tokens_mask for e in encs], 1).bool()
        words = pad_batch([[-1 if w is None else w for w in e.word_ids] for e in encs], -1)
        maskable = keep.bool() & ~special
        words = torch.where(maskable, words, torch.full_like(words, -1))
        inp, labels = mask_tokens(ids, maskable, self.rule, self.mask, self.vocab_size, gen, words)
        batch = {"input_ids": inp, "attention_mask": keep, "labels": labels}
        if self.token_types:
            batch["token_type_ids"] = pad_batch([e.type_ids for e in encs], 0)
        return batch

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, Tensor]:
        n, start = len(self), index * batch_size
        idx = [int(self._perm(k // n)[k % n]) for k in range(start, start + batch_size)]
        return self.masked(idx, generator_for(self.seed, split, index))

    def fixed_batches(self, batch_size: int = 64) -> list[dict[str, Tensor]]:
        """The whole set in order, masked with fixed seeds (the same masks at every evaluation)."""
        n = len(self)
        return [self.masked(list(range(s, min(s + batch_size, n))), generator_for(self.seed, "val", s))
                for s in range(0, len(self), batch_size)]


class MLMRecipe(EncoderRecipe):
    name = "mlm"
    head = "mlm"
    settings = MLMSettings

    def setup_model(self) -> EncoderFolder:
        enc = super().setup_model()
        if "mlm" not in enc.layout().architectures:  # refused now, not after the training
            raise ConfigError(f"{enc.path}: qkv does not write a {enc.model_type} masked-LM folder")
        return enc

    def data(self, path: str) -> tuple[MaskedData, int]:
        rule = MaskingRule(rate=float(self.s.mask_rate), whole_word=bool(self.s.whole_word))
        texts = read_texts(path)
        encs, cut = encode(self.enc.tokenizer, texts, None, self.enc.max_length, "truncate", path)
        types = self.enc.model.config.type_vocab_size > 0
        vocab = self.enc.model.config.vocab_size
        return MaskedData(encs, self.enc.pad_id, self.s.seed, rule, self.mask, vocab, types), cut

    def setup_data(self) -> MaskedData:
        self.mask = mask_id(self.enc)
        self.train_data, self.cut = self.data(self.s.data)
        self.dev = self.data(self.s.dev)[0] if self.s.dev else None
        self.n_labels, self.id2label = self.enc.model.config.num_labels, None
        if self.dev is not None:
            self.before = masked_lm_scores(self.start_model(), self.dev.fixed_batches())
        return self.train_data

    def start_model(self) -> Any:
        """The folder's model when it has an MLM head, else its encoder under a new one."""
        if self.enc.model.config.head == "mlm":
            return self.enc.model.float()
        return new_head_model(self.enc, "mlm", self.enc.model.config.num_labels, self.s.seed)

    def evaluate(self, model: Any) -> dict[str, float]:
        return masked_lm_scores(model, self.dev.fixed_batches())

    def load_best(self, best: dict[str, Any]) -> None:
        """The best checkpoint's weights (a checkpoint stores the tied decoder once, as the word
        embeddings)."""
        missing, unexpected = self.model.load_state_dict(best, strict=False)
        if unexpected or set(missing) - {"mlm_decoder.weight"}:
            raise ConfigError(f"{self.s.out}: the best checkpoint does not fit the model (missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]})")

    def results(self) -> dict[str, Any]:
        out = {"recipe": self.name, "model_type": self.enc.model_type, "texts": len(self.train_data),
               "truncated": self.cut, "steps": self.summary["steps"], "mask_rate": self.train_data.rule.rate,
               "whole_word": self.train_data.rule.whole_word, "out": str(self.s.out)}
        if self.dev is not None:
            out.update(dev_before=self.before, dev=self.evaluate(self.model))
        return out

    def report(self) -> list[str]:
        r = self.result
        lines = [f"masked-LM training of a {r['model_type']} for {r['steps']} steps on {r['texts']} texts "
                 f"({r['mask_rate']:.0%} masked{', whole words' if r['whole_word'] else ''}"
                 f"{f'; {self.cut} cut at the context' if self.cut else ''})"]
        if self.dev is not None:
            b, d = r["dev_before"], r["dev"]
            lines.append(f"dev masked-token loss {b['mlm_loss']:.4f} -> {d['mlm_loss']:.4f} (perplexity "
                         f"{b['perplexity']:.2f} -> {d['perplexity']:.2f}, accuracy "
                         f"{b['mlm_accuracy']:.4f} -> {d['mlm_accuracy']:.4f})")
        lines.append(f"saved {self.s.out} (transformers: AutoModelForMaskedLM.from_pretrained; qkv predict "
                     "--text; qkv.from_pretrained)")
        return lines


register_recipe(Recipe("mlm", ("encoder",), "masked-LM training (BERT's 15%, 80/10/10, --whole-word) of an "
                       "encoder folder on a text file, one text per line", MLMRecipe))
