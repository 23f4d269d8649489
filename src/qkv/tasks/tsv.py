"""Translation on any user TSV file of sentence pairs: one `source<TAB>target` per line (UTF-8).

Blank lines are skipped; a non-blank line without exactly one tab is an error naming the line. Pairs whose
source or target is longer than `max_len` tokens are dropped (the count is kept in `n_dropped`).
Split: the pairs are shuffled with `seed` and the last `val_fraction` (at least one pair) held out; as the
same sentence can occur twice in a file, the split is by pair, not by distinct source.
Tokenizer: `char` (the distinct characters of the whole file, one vocabulary for both sides) or `bpe`
(byte-level BPE trained on the train pairs, both sides, `bpe_vocab_size` tokens).
Batches: `batch_size` train pairs drawn with replacement by a stream seeded by (seed, split, index);
encoding per family as in seq2seq.py. Metrics: exact match, token accuracy and BLEU (sacrebleu, with
`bleu_tokenize`: '13a' for space-separated languages, 'zh' for Chinese, 'char' ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from qkv.config import ConfigError, setting
from qkv.tasks.base import Task, read_text_file, register_task, rng_for, text_lines, text_sha256
from qkv.tasks.options import check_option, check_options
from qkv.tasks.seq2seq import PairTask
from qkv.tasks.tokenizers import BPETokenizer, CharTokenizer, Tokenizer


def read_pairs(path: str | Path) -> list[tuple[str, str]]:
    p = Path(path)
    return parse_pairs(read_text_file(p, "TSV file"), p)


def parse_pairs(text: str, p: Path) -> list[tuple[str, str]]:
    """The sentence pairs of a TSV file's text (read_pairs); errors name `p` and the line."""
    pairs = []
    for i, line in enumerate(text_lines(text), 1):
        if not line.strip():
            continue
        cols = line.split("\t")
        if len(cols) != 2:
            raise ConfigError(f"{p}:{i}: expected 'source<TAB>target', found {len(cols) - 1} tabs")
        src, tgt = cols[0].strip(), cols[1].strip()
        if not src or not tgt:
            raise ConfigError(f"{p}:{i}: empty source or target")
        pairs.append((src, tgt))
    if not pairs:
        raise ConfigError(f"TSV file has no sentence pairs: {p}")
    return pairs


@dataclass
class TSVOptions:
    path: str = setting("", "the TSV file of source<TAB>target lines; required")
    tokenizer: Literal["char", "bpe"] = setting("char", "char, or bpe (byte-level BPE of the train pairs)")
    bpe_vocab_size: int = setting(1024, "BPE vocabulary, specials and the 256 bytes included")
    max_len: int = setting(128, "longest source/target kept, in tokens", ge=1)
    val_fraction: float = setting(0.1, "share of the pairs held out", gt=0, lt=1)
    seed: int = setting(0, "seeds the train/val split and the batch stream")
    bleu_tokenize: str = setting("13a", "sacrebleu's tokenizer for BLEU: 13a, zh, char, intl, none, ...")

    def validate(self) -> None:
        check_options(self)
        check_option(bool(self.path), "path", "is required: a file of source<TAB>target lines")
        from sacrebleu.metrics.bleu import BLEU  # noqa: PLC0415  (sacrebleu: an optional extra, for BLEU)

        check_option(self.bleu_tokenize in BLEU.TOKENIZERS, "bleu_tokenize",
                     f"must be one of {list(BLEU.TOKENIZERS)}, got {self.bleu_tokenize!r}")


class TSVTask(PairTask):
    def __init__(self, options: TSVOptions, family: str, tokenizer: Tokenizer | None = None) -> None:
        self.options = o = options
        self.family = family
        self.bleu_tokenize = o.bleu_tokenize
        self.missing = None
        # absolute in task.json: `qkv eval` and --resume from another folder read the same file
        o.path = str(Path(o.path).expanduser().resolve())
        try:
            text = read_text_file(o.path, "TSV file")
            self.data_sha256 = text_sha256(text)
            pairs = parse_pairs(text, Path(o.path))
        except ConfigError as e:
            if tokenizer is None:
                raise
            # rebuilt from a run folder whose TSV is gone: translate with the saved tokenizer, no batches
            self.tokenizer, self.missing, self.split_pairs, self.n_dropped = tokenizer, str(e), {}, 0
            self.max_src_tokens = self.max_tgt_tokens = o.max_len
            return
        order = list(range(len(pairs)))
        rng_for(o.seed, "split", 0, "tsv").shuffle(order)
        n_val = max(1, round(len(pairs) * o.val_fraction))
        if n_val >= len(pairs):
            raise ConfigError(f"{o.path} has {len(pairs)} pair(s): too few to hold out a validation split")
        train = [pairs[i] for i in order[:-n_val]]
        val = [pairs[i] for i in order[-n_val:]]
        if tokenizer is None:
            if o.tokenizer == "char":
                tokenizer = CharTokenizer.from_text(s + t for s, t in pairs)
            else:
                tokenizer = BPETokenizer.train([s for s, _ in train] + [t for _, t in train],
                                               vocab_size=o.bpe_vocab_size)
        self.tokenizer = tokenizer
        self.n_dropped = 0
        self.split_pairs = {"train": self._keep(train), "val": self._keep(val)}
        for split, kept in self.split_pairs.items():
            if not kept:
                raise ConfigError(f"{o.path}: every {split} pair is longer than max_len={o.max_len} tokens")
        enc = [self.encode_pair(s, t) for ps in self.split_pairs.values() for s, t in ps]
        self.max_src_tokens = max(len(s) for s, _ in enc)
        self.max_tgt_tokens = max(len(t) for _, t in enc)

    def _keep(self, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
        out = []
        for s, t in pairs:
            es, et = self.encode_pair(s, t)
            if len(es) <= self.options.max_len and len(et) <= self.options.max_len and es and et:
                out.append((s, t))
            else:
                self.n_dropped += 1
        return out

    def _need_data(self) -> None:
        if self.missing:
            raise ConfigError(self.missing)

    def pairs(self, index: int, batch_size: int, split: str) -> list[tuple[str, str]]:
        self._need_data()
        data = self.split_pairs[split]
        rng = rng_for(self.options.seed, split, index, "tsv")
        return [data[rng.randrange(len(data))] for _ in range(batch_size)]

    def eval_pairs(self, n: int) -> list[tuple[str, str]]:
        self._need_data()
        return self.split_pairs["val"][:n]


def _factory(options: TSVOptions, family: str, tokenizer: Tokenizer | None = None) -> Task:
    return TSVTask(options, family, tokenizer)


register_task("tsv", TSVOptions, _factory, ("seq2seq", "decoder"),
              "translation on a user TSV file of source<TAB>target pairs", default_family="encdec",
              requires=("sacrebleu",))
