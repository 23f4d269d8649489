"""`qkv finetune DIR --task seq2seq --data pairs.tsv [--dev dev.tsv] --out OUT`: fine-tune an encoder-decoder
(T5, BART, Marian folders, or a qkv encdec checkpoint) on the user's source/target pairs.

Data: one pair per line, `source<TAB>target`, UTF-8 (blank lines skipped). A line without a tab, with an empty
source or target, or longer than --max-source-length / --max-target-length tokens (after tokenisation) is one
clear error naming the file and line (--too-long truncate: cut and count instead). Training is the library's
Trainer (AdamW, warmup + decay, clipping, bf16, checkpoints, --resume), seeded before anything is built; an
epoch is one pass over the shuffled pairs. Every epoch the dev pairs are decoded (greedy, or --num-beams) and
scored with sacrebleu's BLEU and chrF, rouge-score's ROUGE-1/2/L, plus exact match; checkpoints/best keeps the
best epoch (train.best_metric, default bleu; rougeL for summaries). Summaries: --length-penalty,
--no-repeat-ngram-size and --min-new-tokens shape the dev decoding.

OUT is a model folder: a Hugging Face folder (the source's config.json, generation_config.json and tokenizer
files, the weights under HF's names) that `transformers` and `qkv.from_pretrained` load to the same logits, or
a qkv folder when the source was one; beside it the run's metrics.jsonl, curves.png and checkpoints/.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import qkv
from qkv.config import ConfigError, setting
from qkv.extras import require
from qkv.finetune.data import read_data_text
from qkv.finetune.out import mark_out
from qkv.finetune.recipe import FinetuneRecipe, epoch_config
from qkv.finetune.registry import Recipe, register_recipe
from qkv.finetune.settings import FinetuneSettings
from qkv.interop.export import writable_types, write_model
from qkv.interop.export_tokenizer import copy_tokenizer_files
from qkv.interop.registry import ExportRequest
from qkv.tasks.base import text_lines
from qkv.tasks.tokenizers import find_tokenizer
from qkv.train import Trainer, read_checkpoint, seed_everything


# -- data -------------------------------------------------------------------------------------------------
def read_pairs(path: str | Path) -> list[tuple[str, str, int]]:
    """(source, target, line number) of a `source<TAB>target` file; bad rows are one clear error."""
    p = Path(path)
    lines = text_lines(read_data_text(p, "{path}:{line}"))  # a BOM dropped; not UTF-8: file:line
    pairs = []
    for n, line in enumerate(lines, 1):
        if not line.strip() and "\t" not in line:
            continue  # a blank line (the other readers skip them too); a lone tab is an empty source below
        if "\t" not in line:
            raise ConfigError(f"{p}:{n}: no tab between source and target (each line is source<TAB>target)")
        parts = line.split("\t")
        if len(parts) != 2:
            raise ConfigError(f"{p}:{n}: {len(parts) - 1} tabs; each line is exactly source<TAB>target")
        src, tgt = parts[0].strip(), parts[1].strip()
        if not src or not tgt:
            raise ConfigError(f"{p}:{n}: empty {'source' if not src else 'target'}")
        pairs.append((src, tgt, n))
    if not pairs:
        raise ConfigError(f"{p}: no pairs (each line is source<TAB>target)")
    return pairs


@dataclass
class Encoded:
    sources: list[list[int]]
    targets: list[list[int]]
    texts: list[tuple[str, str]]
    truncated: int


def encode_pairs(pairs: list[tuple[str, str, int]], tok: Any, path: str, max_src: int, max_tgt: int,
                 truncate: bool) -> Encoded:
    enc_target = getattr(tok, "encode_target", tok.encode)
    out = Encoded([], [], [], 0)
    for src, tgt, n in pairs:
        s, t = list(tok.encode(src)), list(enc_target(tgt))
        if len(s) > max_src or len(t) > max_tgt:
            if not truncate:
                side, length, limit = (
                    ("source", len(s), max_src) if len(s) > max_src else ("target", len(t), max_tgt)
                )
                raise ConfigError(f"{path}:{n}: {side} is {length} tokens, over --max-{side}-length {limit} "
                                  "(raise the limit, or pass --too-long truncate to cut and count such "
                                  "pairs)")
            out.truncated += 1
            s, t = s[:max_src], t[:max_tgt]
        out.sources.append(s)
        out.targets.append(t)
        out.texts.append((src, tgt))
    return out


class PairSource:
    """The Trainer's batch source: shuffled pairs, one permutation per epoch (seeded), right-padded."""

    # the first is the default best metric (train.best_metric=rougeL for summaries)
    metrics = {"bleu": "max", "chrf": "max", "rouge1": "max", "rouge2": "max", "rougeL": "max",
               "exact_match": "max"}

    def __init__(self, data: Encoded, pad: int, seed: int) -> None:
        self.data, self.pad, self.seed = data, pad, seed

    def __len__(self) -> int:
        return len(self.data.sources)

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, torch.Tensor]:
        n = len(self)
        per_epoch = math.ceil(n / batch_size)
        epoch, j = divmod(index, per_epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
        return collate([self.data.sources[i] for i in order[j * batch_size : (j + 1) * batch_size].tolist()],
                       [self.data.targets[i] for i in order[j * batch_size : (j + 1) * batch_size].tolist()],
                       self.pad)


def collate(sources: list[list[int]], targets: list[list[int]] | None, pad: int) -> dict[str, torch.Tensor]:
    S = max(len(s) for s in sources)
    ids = torch.full((len(sources), S), pad, dtype=torch.long)
    mask = torch.zeros(len(sources), S, dtype=torch.long)
    for i, s in enumerate(sources):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    batch = {"input_ids": ids, "attention_mask": mask}
    if targets is not None:
        T = max(len(t) for t in targets)
        labels = torch.full((len(targets), T), -100, dtype=torch.long)
        for i, t in enumerate(targets):
            labels[i, : len(t)] = torch.tensor(t)
        batch["labels"] = labels
    return batch


# -- evaluation -------------------------------------------------------------------------------------------
def translate(model: Any, tok: Any, sources: list[list[int]], pad: int, *, batch_size: int = 32,
              **gen: Any) -> list[str]:
    out = []
    for i in range(0, len(sources), batch_size):
        b = collate(sources[i:i + batch_size], None, pad)
        seqs = model.generate(b["input_ids"].to(model.lm_head.weight.device),
                              attention_mask=b["attention_mask"].to(model.lm_head.weight.device), **gen)
        out += [tok.decode([int(t) for t in row]).strip() for row in seqs.tolist()]
    return out


ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def rouge(hyps: list[str], refs: list[str]) -> dict[str, float]:
    """ROUGE-1, ROUGE-2 (n-gram overlap) and ROUGE-L (longest common subsequence): the mean over pairs of each
    pair's F1, x 100, from Google's `rouge-score` (Porter stemming, its lower-cased a-z0-9 tokens: text in
    other scripts scores 0 there), as Hugging Face `evaluate`'s rouge reports it."""
    scorer = require("rouge_score.rouge_scorer", "ROUGE of qkv finetune --task seq2seq").RougeScorer(
        list(ROUGE_TYPES), use_stemmer=True)
    per_pair = [scorer.score(r, h) for h, r in zip(hyps, refs)]
    return {t: 100.0 * sum(p[t].fmeasure for p in per_pair) / max(1, len(per_pair)) for t in ROUGE_TYPES}


def scores(hyps: list[str], refs: list[str]) -> dict[str, float]:
    """BLEU and chrF (sacrebleu, corpus level), ROUGE-1/2/L (rouge) and the share of exact matches."""
    sacrebleu = require("sacrebleu", "BLEU and chrF of qkv finetune --task seq2seq")
    return {"bleu": sacrebleu.corpus_bleu(hyps, [refs]).score,
            "chrf": sacrebleu.corpus_chrf(hyps, [refs]).score, **rouge(hyps, refs),
            "exact_match": sum(h == r for h, r in zip(hyps, refs)) / max(1, len(refs))}


# -- saving -----------------------------------------------------------------------------------------------
def save_folder(model: Any, source: Path, out: Path) -> Path:
    """Write the fine-tuned model as a folder of the source's kind (HF or qkv), with its tokenizer files."""
    meta = json.loads((source / "config.json").read_text(encoding="utf-8"))
    mt = meta.get("model_type")
    if "qkv_family" in meta or mt is None:
        model.save_pretrained(out)
    elif mt in writable_types(kind="seq2seq"):
        write_model(model, out, ExportRequest(mt, source))
    else:
        raise ConfigError(f"{source}: cannot write a fine-tuned {mt!r} folder (seq2seq fine-tunes "
                          f"{', '.join(writable_types(kind='seq2seq'))})")
    copy_tokenizer_files(source, out)
    return out


# -- the recipe -------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Seq2SeqSettings(FinetuneSettings):
    RECIPE = "seq2seq"
    TOO_LONG = ("error", "truncate")

    batch_size: int = setting(16, "pairs per batch (the same as train.batch_size: give one)")
    lr: float = setting(3e-4, "peak learning rate (the same as train.lr: give one)")
    max_source_length: int = setting(256, "source tokens at most")
    max_target_length: int = setting(128, "target tokens at most")
    num_beams: int = setting(1, "beams for decoding the dev file (1: greedy)")
    # summaries: length control in the dev decoding (the same fields as qkv generate's)
    length_penalty: float = setting(1.0, "beam score = sum log p / length ** length_penalty (> 1 favours "
                                         "longer outputs)")
    no_repeat_ngram_size: int = setting(0, "no n-gram of this size occurs twice in a dev output (0: off)")
    min_new_tokens: int = setting(0, "no end-of-sequence before this many tokens")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.epochs <= 0 or self.batch_size < 1 or self.num_beams < 1:
            raise ConfigError("--epochs must be positive, --batch-size and --num-beams at least 1")
        if self.no_repeat_ngram_size < 0 or self.min_new_tokens < 0:
            raise ConfigError("--no-repeat-ngram-size and --min-new-tokens must be >= 0")
        if self.max_source_length < 1 or self.max_target_length < 1:
            raise ConfigError("--max-source-length and --max-target-length must be at least 1")


class Seq2SeqRecipe(FinetuneRecipe):
    """The seq2seq recipe in named phases (qkv.finetune.recipe): setup_model (the folder's model and
    tokenizer), setup_data (pairs encoded and checked against the vocabulary), train, save (the best epoch's
    weights as a model folder), report (the lines qkv finetune prints)."""

    name = "seq2seq"
    settings = Seq2SeqSettings

    def setup_model(self) -> Any:
        source = Path(self.s.model)
        # scored with sacrebleu each epoch: say it is missing now, not after an epoch of training
        if self.s.dev:
            require("sacrebleu", "BLEU and chrF of qkv finetune --task seq2seq --dev")
            require("rouge_score", "ROUGE of qkv finetune --task seq2seq --dev")
        seed_everything(self.s.seed)  # before anything is built: one seed gives the same run in a new process
        self.model = qkv.from_pretrained(source)
        if not getattr(self.model, "is_seq2seq", False) or self.model.kind != "seq2seq":
            raise ConfigError(f"{source}: --task seq2seq fine-tunes encoder-decoder models, not "
                              f"{type(self.model).__name__}")
        self.tok = find_tokenizer(source)
        if self.tok is None:
            raise ConfigError(f"{source} has no tokenizer (tokenizer.json, or source.spm/spiece.model): "
                              f"cannot read text pairs")
        return self.model

    def setup_data(self) -> PairSource:
        s, model, tok = self.s, self.model, self.tok
        vocab = model.config.target_vocab_size
        limit = model.encoder.context_limit
        max_src = min(s.max_source_length, limit) if limit else s.max_source_length
        self.max_tgt = (
            min(s.max_target_length, model.context_limit) if model.context_limit else s.max_target_length
        )
        truncate = s.too_long == "truncate"
        self.train_pairs = encode_pairs(read_pairs(s.data), tok, s.data, max_src, self.max_tgt, truncate)
        self.dev = (encode_pairs(read_pairs(s.dev), tok, s.dev, max_src, self.max_tgt, truncate)
                    if s.dev else None)
        for enc, path in ((self.train_pairs, s.data), (self.dev, s.dev)):
            if enc is not None:
                bad = [i for x in enc.sources + enc.targets for i in x if not 0 <= i < vocab]
                if bad:
                    raise ConfigError(f"{path}: the tokenizer gives id {bad[0]}, outside the model's "
                                      f"vocabulary of {vocab}: tokenizer and model do not match")
        self.data = PairSource(self.train_pairs, model.config.pad_token_id, s.seed)
        return self.data

    def evaluate(self, m: Any) -> dict[str, float]:
        """BLEU, chrF and ROUGE of the --dev outputs (beam search, greedy with --num-beams 1; the length
        settings of the command line)."""
        model = self.model
        # the decoder holds its start token too: a target as long as the context leaves one position fewer
        max_new = min(self.max_tgt, model.context_limit - 1) if model.context_limit else self.max_tgt
        gen = {"num_beams": self.s.num_beams, "max_new_tokens": max_new, "do_sample": False,
               "length_penalty": self.s.length_penalty, "no_repeat_ngram_size": self.s.no_repeat_ngram_size,
               "min_new_tokens": min(self.s.min_new_tokens, max_new)}
        refs = [t for _, t in self.dev.texts]
        return scores(translate(m, self.tok, self.dev.sources, model.config.pad_token_id, **gen), refs)

    def train(self) -> dict[str, Any]:
        s = self.s
        defaults = {"batch_size": s.batch_size, "lr": s.lr, "warmup": 0.06, "schedule": "linear",
                    "weight_decay": 0.01, "betas": [0.9, 0.999]}
        train_cfg = epoch_config(s, defaults, len(self.data), self.dev is not None)
        self.model.train()
        mark_out(s.out, "seq2seq")  # the data are read and checked: the run starts
        trainer = Trainer(self.model, train_cfg, self.data,
                          eval_fn=self.evaluate if self.dev is not None else None)
        self.summary = trainer.fit()
        return self.summary

    def save(self) -> dict[str, Any]:
        best = self.summary.get("best_checkpoint")
        if best and Path(best).is_dir():  # the best epoch's weights go into the output folder
            state, _ = read_checkpoint(best)
            self.model.load_state_dict(state, strict=False)
        self.model.eval()
        save_folder(self.model, Path(self.s.model), self.s.out)
        return self.summary

    def report(self) -> list[str]:
        s, summary, truncated = self.s, self.summary, self.train_pairs.truncated
        lines = [f"fine-tuned {Path(s.model)} on {len(self.data)} pairs ({s.epochs:g} epochs, "
                 f"{summary['steps']} steps)"
                 + (f"; {truncated} over-long pairs truncated" if truncated else "")]
        if summary.get("best_eval"):
            ev = summary["best_eval"]
            lines.append(f"best dev {ev['metric']} {ev['value']:.2f} at step {ev['step']}")
        if summary.get("eval"):
            lines.append("last dev: " + ", ".join(f"{k} {v:.3f}" for k, v in summary["eval"].items()))
        lines.append(f"model folder: {s.out} (qkv.from_pretrained / transformers load it)")
        return lines


register_recipe(Recipe("seq2seq", ("seq2seq",), "encoder-decoder models (T5, BART, Marian): "
                                                "source<TAB>target pairs, "
                       "BLEU / chrF / ROUGE on --dev each epoch", Seq2SeqRecipe))
