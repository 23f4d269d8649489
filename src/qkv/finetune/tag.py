"""`qkv finetune DIR --task tag`: token classification (NER, chunking) from CoNLL files with a BERT-family
encoder.

    qkv finetune bert-folder --task tag --data train.conll --dev dev.conll --out ner [--epochs 3]

CoNLL: one token per line, its tag in the last column (--tag-column), a blank line between sentences,
-DOCSTART- lines skipped. Tags are BIO (IOB2) or IOBES: O, B-PER, I-PER, ... Each word is labelled on its
first sub-token (the others and the special tokens carry -100, no loss) and predicted from it.

Metric: entity-level precision / recall / F1 with the chunking rules of CoNLL's conlleval script, which is
what `seqeval` computes in its default mode: an entity is a maximal chunk of one type, started by B- (or by
an I- that follows O or another type) and ended by the next B-, O or type change. Written here (25 lines)
rather than depending on seqeval, which is unmaintained since 2020 and pulls scikit-learn into the core
install; the tests cross-check this implementation against seqeval on random tag sequences.
OUT is a Hugging Face folder (AutoModelForTokenClassification; qkv.from_pretrained) with the tokenizer files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv.config import ConfigError, setting
from qkv.finetune.data import read_data_text
from qkv.finetune.encoders import EncodedData, encode, predict
from qkv.finetune.phases import EncoderRecipe
from qkv.finetune.registry import Recipe, register_recipe
from qkv.finetune.settings import FinetuneSettings
from qkv.tasks.base import text_lines

METRICS = {"f1": "max", "precision": "max", "recall": "max", "token_accuracy": "max"}
CHUNK_TAGS = ("B", "I", "E", "S")


@dataclass(kw_only=True)
class TagSettings(FinetuneSettings):
    RECIPE = "tag"
    TOO_LONG = ("truncate", "error")

    too_long: str = "truncate"
    tag_column: int = setting(-1, "CoNLL column holding the tag (-1: the last)")


# -- CoNLL files ----------------------------------------------------------------------------------------
def read_conll_lines(path: str | Path,
                     tag_column: int = -1) -> tuple[list[tuple[list[str], list[str]]], list[int]]:
    """(sentences, the line of each sentence's first token): a sentence's token j is on line first + j, so an
    error about a sentence (too long, an unknown tag) can name the file and line like the other readers do.
    Every token line has the columns of the file's first one: a line with more or fewer (a token with a space
    in it, a missing POS column) would put another column under --tag-column, so it is an error naming it."""
    sentences: list[tuple[list[str], list[str]]] = []
    starts: list[int] = []
    words: list[str] = []
    tags: list[str] = []
    width: tuple[int, int] | None = None  # (columns, line) of the first token line
    # a BOM dropped; not UTF-8: file and line
    for i, line in enumerate(text_lines(read_data_text(path)) + [""], 1):
        parts = line.split()
        if not parts or parts[0] == "-DOCSTART-":
            if words:
                sentences.append((words, tags))
                starts.append(i - len(words))
            words, tags = [], []
            continue
        if len(parts) < 2:
            raise ConfigError(f"{path} line {i}: expected a token and its tag, got {line.strip()!r}")
        if width is None:
            width = (len(parts), i)
        elif len(parts) != width[0]:
            raise ConfigError(f"{path} line {i}: {len(parts)} columns, line {width[1]} has {width[0]} (every "
                              f"token line of a CoNLL file has the same columns)")
        try:
            tag = parts[tag_column]
        except IndexError:
            raise ConfigError(f"{path} line {i}: no column {tag_column} in {line.strip()!r}") from None
        if tag != "O" and (len(tag) < 3 or tag[0] not in CHUNK_TAGS or tag[1] != "-"):
            raise ConfigError(f"{path} line {i}: {tag!r} is not a BIO/IOBES tag (O, B-TYPE, I-TYPE, ...)")
        words.append(parts[0])
        tags.append(tag)
    if not sentences:
        raise ConfigError(f"{path}: no sentences (CoNLL: token ... tag per line, blank line between "
                          "sentences)")
    return sentences, starts


# -- entity-level scores (conlleval's chunk rules)
# ------------------------------------------------------------
def _split(tag: str) -> tuple[str, str]:
    return ("O", "") if tag == "O" else (tag[0], tag[2:])


def entities(tags: list[str]) -> set[tuple[str, int, int]]:
    """(type, first, last) of every chunk. A chunk ends before a B/S, an O, a type change, or after an E/S; it
    starts at a B/S, at an I/E after O/E/S, or at a type change."""
    out = set()
    start, prev, prev_type = None, "O", ""
    for i, tag in enumerate([*tags, "O"]):  # the sentinel O closes the last chunk
        chunk, typ = _split(tag)
        ends = prev in ("E", "S") or (prev in ("B", "I") and chunk in ("B", "S", "O")) or \
            (prev != "O" and typ != prev_type)
        if start is not None and ends:
            out.add((prev_type, start, i - 1))
            start = None
        begins = chunk in ("B", "S") or (prev in ("E", "S", "O") and chunk in ("I", "E")) or \
            (chunk != "O" and typ != prev_type)
        if begins:
            start = i
        prev, prev_type = chunk, typ
    return out


def entity_scores(gold: list[list[str]], pred: list[list[str]]) -> dict[str, float]:
    """Micro precision / recall / F1 over entities (each sentence scored apart), and token accuracy."""
    n_gold = n_pred = n_ok = tok_ok = tok_n = 0
    for g, p in zip(gold, pred):
        eg, ep = entities(g), entities(p)
        n_gold, n_pred, n_ok = n_gold + len(eg), n_pred + len(ep), n_ok + len(eg & ep)
        tok_ok += sum(a == b for a, b in zip(g, p))
        tok_n += len(g)
    prec = n_ok / n_pred if n_pred else 0.0
    rec = n_ok / n_gold if n_gold else 0.0
    f1 = 2 * prec * rec / (prec + rec) if prec + rec else 0.0
    return {"f1": f1, "precision": prec, "recall": rec, "token_accuracy": tok_ok / max(1, tok_n)}


# -- alignment ------------------------------------------------------------------------------------------
def word_labels(encoding: Any, tags: list[str], tag_id: dict[str, int]) -> list[int]:
    """One label per sub-token: the word's tag on its first sub-token, -100 elsewhere."""
    out, seen = [], set()
    for w in encoding.word_ids:
        if w is None or w in seen:
            out.append(-100)
        else:
            seen.add(w)
            out.append(tag_id[tags[w]])
    return out


def predicted_tags(logits: Any, encoding: Any, n_words: int, names: dict[int, str]) -> list[str]:
    """A tag per word from its first sub-token; words cut off by truncation are predicted O."""
    tags = ["O"] * n_words
    seen = set()
    for pos, w in enumerate(encoding.word_ids):
        if w is not None and w not in seen and pos < logits.shape[0]:
            seen.add(w)
            tags[w] = names[int(logits[pos].argmax())]
    return tags


def _encode(enc: Any, sentences: list[tuple[list[str], list[str]]], too_long: str,
            source: str, lines: list[int]) -> tuple[list[Any], int]:
    return encode(enc.tokenizer, [w for w, _ in sentences], None, enc.max_length, too_long, source,
                  pretokenized=True, lines=lines)


class TagRecipe(EncoderRecipe):
    """Token classification (CoNLL BIO tags) in the shared encoder phases (qkv.finetune.phases)."""

    name = head = "tag"
    settings = TagSettings

    def setup_data(self) -> EncodedData:
        s, enc = self.s, self.enc
        train_s, train_lines = read_conll_lines(s.data, s.tag_column)
        self.names = sorted({t for _, tags in train_s for t in tags}, key=lambda t: (t != "O", t[2:], t))
        tag_id = {t: i for i, t in enumerate(self.names)}
        self.id2label, self.n_labels = dict(enumerate(self.names)), len(self.names)
        train_enc, self.cut = _encode(enc, train_s, s.too_long, s.data, train_lines)
        self.types = enc.model.config.type_vocab_size > 1
        self.train_data = EncodedData(train_enc,
                                      [word_labels(e, t, tag_id) for e, (_, t) in zip(train_enc, train_s)],
                                      enc.pad_id, s.seed, METRICS, token_types=self.types)
        self.dev_cut = 0
        if s.dev:
            self._setup_dev(tag_id)
        return self.train_data

    def _setup_dev(self, tag_id: dict[str, int]) -> None:
        """The --dev sentences, encoded; a tag the training data never showed is an error naming its line."""
        s, enc = self.s, self.enc
        self.dev_s, dev_lines = read_conll_lines(s.dev, s.tag_column)
        for (words, tags), first in zip(self.dev_s, dev_lines):
            unknown = [j for j, t in enumerate(tags) if t not in tag_id]
            if unknown:
                j = unknown[0]
                raise ConfigError(f"{s.dev} line {first + j}: tag {tags[j]!r} (in {' '.join(words[:8])!r}) "
                                  f"does not occur in the training data (tags: {', '.join(self.names[:20])})")
        dev_enc, self.dev_cut = _encode(enc, self.dev_s, s.too_long, s.dev, dev_lines)
        self.dev = EncodedData(dev_enc, [word_labels(e, t, tag_id) for e, (_, t) in zip(dev_enc, self.dev_s)],
                               enc.pad_id, s.seed, token_types=self.types)

    def evaluate(self, model: Any) -> dict[str, float]:
        logits = predict(model, self.dev)
        pred = [predicted_tags(lg, e, len(w), self.id2label)
                for lg, e, (w, _) in zip(logits, self.dev.encodings, self.dev_s)]
        return entity_scores([t for _, t in self.dev_s], pred)

    def results(self) -> dict[str, Any]:
        summary = self.summary
        result: dict[str, Any] = {"recipe": "tag", "task": "tag", "tags": self.names,
                                  "train_sentences": len(self.train_data),
                                  "truncated": {"train": self.cut, "dev": self.dev_cut},
                                  "steps": summary["steps"], "best": summary.get("best_eval"),
                                  "out": str(self.s.out)}
        if self.dev is not None:
            result["dev"] = self.evaluate(self.model)
        return result

    def report(self) -> list[str]:
        lines = [f"fine-tuned {self.enc.model_type} for token classification, {self.summary['steps']} steps "
                 f"on {len(self.train_data)} sentences ({len(self.names)} tags)"]
        if self.cut or self.dev_cut:
            lines.append(f"truncated to {self.enc.max_length} tokens: {self.cut} training and {self.dev_cut} "
                         f"dev sentence(s) (words cut off are predicted O)")
        if self.dev is not None:
            final = self.result["dev"]
            lines.append(f"dev ({len(self.dev)} sentences): entity F1 {final['f1']:.4f} (precision "
                         f"{final['precision']:.4f}, recall {final['recall']:.4f}), token accuracy "
                         f"{final['token_accuracy']:.4f}")
        lines.append(f"saved {self.s.out} (transformers: AutoModelForTokenClassification.from_pretrained; "
                     "qkv.from_pretrained)")
        return lines


register_recipe(Recipe("tag", ("encoder",), "token classification (NER, BIO tags in CoNLL format) with a "
                       "BERT-family encoder", TagRecipe))
