"""`qkv finetune DIR --task seq2seq --data pairs.tsv [--dev dev.tsv] --out OUT`: fine-tune an encoder-decoder
(T5, BART, Marian folders, or a qkv encdec checkpoint) on the user's source/target pairs.

Data: one pair per line, `source<TAB>target`, UTF-8 (blank lines skipped). A line without a tab, with an empty
source or target, or longer than --max-source-length / --max-target-length tokens (after tokenisation) is one
clear error naming the file and line (--too-long truncate: cut and count instead). Training is the library's Trainer (AdamW, warmup +
decay, clipping, bf16, checkpoints, --resume), seeded before anything is built; an epoch is one pass over the
shuffled pairs. Every epoch the dev pairs are decoded (greedy, or --num-beams) and scored with sacrebleu's
BLEU and chrF, plus exact match; checkpoints/best keeps the best epoch (train.best_metric, default bleu).

OUT is a model folder: a Hugging Face folder (the source's config.json, generation_config.json and tokenizer
files, the weights under HF's names) that `transformers` and `qkv.from_pretrained` load to the same logits, or
a qkv folder when the source was one; beside it the run's metrics.jsonl, curves.png and checkpoints/.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qkv.config import ConfigError, parse_overrides
from qkv.finetune import (
    Recipe,
    epoch_updates,
    epochs_to_steps,
    mark_out,
    read_data_text,
    register_recipe,
    shared,
)
from qkv.tasks.base import text_lines

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "spiece.model",
                   "source.spm", "target.spm", "vocab.json", "generation_config.json")


def add_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--batch-size", type=int, default=16,
                   help="pairs per batch (default 16; the same as train.batch_size: give one)")
    g.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4; the same as train.lr: give one)")
    g.add_argument("--max-source-length", type=int, default=256, help="source tokens at most (default 256)")
    g.add_argument("--max-target-length", type=int, default=128, help="target tokens at most (default 128)")
    g.add_argument("--num-beams", type=int, default=1, help="beams for decoding the dev file (default 1: greedy)")


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


def _ids(enc: Any) -> list[int]:
    return list(enc.ids) if hasattr(enc, "ids") else list(enc)


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
        s, t = _ids(tok.encode(src)), _ids(enc_target(tgt))
        if len(s) > max_src or len(t) > max_tgt:
            if not truncate:
                side, length, limit = ("source", len(s), max_src) if len(s) > max_src else ("target", len(t), max_tgt)
                raise ConfigError(f"{path}:{n}: {side} is {length} tokens, over --max-{side}-length {limit} "
                                  f"(raise the limit, or pass --too-long truncate to cut and count such pairs)")
            out.truncated += 1
            s, t = s[:max_src], t[:max_tgt]
        out.sources.append(s)
        out.targets.append(t)
        out.texts.append((src, tgt))
    return out


class PairSource:
    """The Trainer's batch source: shuffled pairs, one permutation per epoch (seeded), right-padded."""

    metrics = {"bleu": "max", "chrf": "max", "exact_match": "max"}  # the first is the default best metric

    def __init__(self, data: Encoded, pad: int, seed: int) -> None:
        self.data, self.pad, self.seed = data, pad, seed

    def __len__(self) -> int:
        return len(self.data.sources)

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, torch.Tensor]:
        n = len(self)
        per_epoch = math.ceil(n / batch_size)
        epoch, j = divmod(index, per_epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
        return collate([self.data.sources[i] for i in order[j * batch_size:(j + 1) * batch_size].tolist()],
                       [self.data.targets[i] for i in order[j * batch_size:(j + 1) * batch_size].tolist()], self.pad)


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
def translate(model: Any, tok: Any, sources: list[list[int]], pad: int, *, batch_size: int = 32, **gen: Any) -> list[str]:
    out = []
    for i in range(0, len(sources), batch_size):
        b = collate(sources[i:i + batch_size], None, pad)
        seqs = model.generate(b["input_ids"].to(model.lm_head.weight.device),
                              attention_mask=b["attention_mask"].to(model.lm_head.weight.device), **gen)
        out += [tok.decode([int(t) for t in row]).strip() for row in seqs.tolist()]
    return out


def scores(hyps: list[str], refs: list[str]) -> dict[str, float]:
    from qkv.extras import require

    sacrebleu = require("sacrebleu", "BLEU and chrF of qkv finetune --task seq2seq")
    return {"bleu": sacrebleu.corpus_bleu(hyps, [refs]).score, "chrf": sacrebleu.corpus_chrf(hyps, [refs]).score,
            "exact_match": sum(h == r for h, r in zip(hyps, refs)) / max(1, len(refs))}


# -- saving -----------------------------------------------------------------------------------------------
def save_folder(model: Any, source: Path, out: Path) -> Path:
    """Write the fine-tuned model as a folder of the source's kind (HF or qkv), with its tokenizer files."""
    meta = json.loads((source / "config.json").read_text(encoding="utf-8"))
    mt = meta.get("model_type")
    if "qkv_family" in meta or mt is None:
        model.save_pretrained(out)
    elif mt == "t5":
        from qkv.interop.t5 import save_t5

        save_t5(model, out, meta)
    elif mt in ("bart", "marian"):
        from qkv.interop.bart import save_bart

        save_bart(model, out, meta)
    else:
        raise ConfigError(f"{source}: cannot write a fine-tuned {mt!r} folder (seq2seq fine-tunes t5, bart, marian)")
    for name in TOKENIZER_FILES:  # never a file onto itself
        if (source / name).is_file() and (source / name).resolve() != (out / name).resolve():
            shutil.copyfile(source / name, out / name)
    return out


# -- the recipe -------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    from qkv import from_pretrained
    from qkv.extras import require
    from qkv.tasks.tokenizers import find_tokenizer
    from qkv.train import Trainer, read_checkpoint, seed_everything

    epochs = shared(args, "epochs", 3)
    if epochs <= 0 or args.batch_size < 1 or args.num_beams < 1:
        raise ConfigError("--epochs must be positive, --batch-size and --num-beams at least 1")
    if args.max_source_length < 1 or args.max_target_length < 1:
        raise ConfigError("--max-source-length and --max-target-length must be at least 1")
    if args.dev:  # scored with sacrebleu each epoch: say it is missing now, not after an epoch of training
        require("sacrebleu", "BLEU and chrF of qkv finetune --task seq2seq --dev")
    seed_everything(args.seed)  # before anything is built: one seed gives the same run in a new process
    source = Path(args.model)
    model = from_pretrained(source)
    if not getattr(model, "is_seq2seq", False) or model.kind != "seq2seq":
        raise ConfigError(f"{source}: --task seq2seq fine-tunes encoder-decoder models, not {type(model).__name__}")
    tok = find_tokenizer(source)
    if tok is None:
        raise ConfigError(f"{source} has no tokenizer (tokenizer.json, or source.spm/spiece.model): cannot read text pairs")
    cfg = model.config
    limit = model.encoder.context_limit
    max_src = min(args.max_source_length, limit) if limit else args.max_source_length
    max_tgt = min(args.max_target_length, model.context_limit) if model.context_limit else args.max_target_length
    truncate = shared(args, "too_long", "error", ("error", "truncate"), "seq2seq") == "truncate"
    train = encode_pairs(read_pairs(args.data), tok, args.data, max_src, max_tgt, truncate)
    dev = encode_pairs(read_pairs(args.dev), tok, args.dev, max_src, max_tgt, truncate) if args.dev else None
    for enc, path in ((train, args.data), (dev, args.dev)):
        if enc is not None:
            bad = [i for s in enc.sources + enc.targets for i in s if not 0 <= i < cfg.target_vocab_size]
            if bad:
                raise ConfigError(f"{path}: the tokenizer gives id {bad[0]}, outside the model's vocabulary "
                                  f"of {cfg.target_vocab_size}: tokenizer and model do not match")
    data = PairSource(train, cfg.pad_token_id, args.seed)
    train_cfg = {"batch_size": args.batch_size, "lr": args.lr, "warmup": 0.06, "schedule": "linear",
                 "weight_decay": 0.01, "betas": [0.9, 0.999], "out_dir": str(args.out), "seed": args.seed,
                 "progress": not args.no_progress}
    over = {}
    for key, value in parse_overrides(list(args.overrides)).items():
        if not key.startswith("train."):
            raise ConfigError(f"override {key!r}: qkv finetune takes Trainer settings as train.key=value")
        over[key[len("train."):]] = value
    train_cfg.update(over)
    # an epoch in updates of the batch the Trainer will read (train.batch_size / grad_accum overrides included)
    per_epoch = epoch_updates(len(data), int(train_cfg["batch_size"]), int(train_cfg.get("grad_accum", 1)))
    train_cfg = {"max_steps": epochs_to_steps(float(epochs), per_epoch),
                 "eval_every": per_epoch if dev is not None else 0, "save_every": per_epoch, **train_cfg}
    # the decoder holds its start token too: a target as long as the context leaves one position fewer to generate
    max_new = min(max_tgt, model.context_limit - 1) if model.context_limit else max_tgt
    gen = {"num_beams": args.num_beams, "max_new_tokens": max_new, "do_sample": False}
    refs = [t for _, t in dev.texts] if dev is not None else []

    def eval_fn(m: Any) -> dict[str, float]:
        return scores(translate(m, tok, dev.sources, cfg.pad_token_id, **gen), refs)

    model.train()
    mark_out(args.out, "seq2seq")  # the data are read and checked: the run starts
    trainer = Trainer(model, train_cfg, data, eval_fn=eval_fn if dev is not None else None, resume=args.resume)
    summary = trainer.fit()
    best = summary.get("best_checkpoint")
    if best and Path(best).is_dir():  # the best epoch's weights go into the output folder
        state, _ = read_checkpoint(best)
        model.load_state_dict(state, strict=False)
    model.eval()
    save_folder(model, source, Path(args.out))
    lines = [f"fine-tuned {source} on {len(data)} pairs ({epochs:g} epochs, {summary['steps']} steps)"
             + (f"; {train.truncated} over-long pairs truncated" if train.truncated else "")]
    if summary.get("best_eval"):
        ev = summary["best_eval"]
        lines.append(f"best dev {ev['metric']} {ev['value']:.2f} at step {ev['step']}")
    if summary.get("eval"):
        lines.append("last dev: " + ", ".join(f"{k} {v:.3f}" for k, v in summary["eval"].items()))
    lines.append(f"model folder: {args.out} (qkv.from_pretrained / transformers load it)")
    return {**summary, "report": "\n".join(lines)}


register_recipe(Recipe("seq2seq", ("seq2seq",), "encoder-decoder models (T5, BART, Marian): source<TAB>target pairs, "
                       "BLEU / chrF on --dev each epoch", run, add_arguments))
