"""`qkv finetune DIR --task classify`: text or text-pair classification with a BERT-family encoder.

    qkv finetune bert-folder --data train.csv --dev dev.csv --out clf \
        --text-column sentence [--text-pair-column sentence2] --label-column label [--epochs 3]
        [train.lr=5e-5]

Data: CSV, TSV or JSONL (by extension) with a header / keys; labels are names ("pos") or ids ("1"). The
classifier reads the pooled [CLS] vector (BERT's tanh pooler, RoBERTa's classifier.dense, DistilBERT's
pre_classifier, DeBERTa's ContextPooler: one Linear + activation), trained with qkv.train.Trainer (linear
decay after warmup, AdamW, clipping, bf16 with train.precision=bf16, a checkpoint each epoch, --resume). With
--dev: accuracy and macro-F1 each epoch, the best (macro-F1) checkpoint kept and exported, and confusion.png.
OUT is then a Hugging Face folder (AutoModelForSequenceClassification; qkv.from_pretrained) with the source's
tokenizer files.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv.config import ConfigError, setting
from qkv.finetune.data import column, read_records
from qkv.finetune.encoders import EncodedData, encode, predict
from qkv.finetune.phases import EncoderRecipe
from qkv.finetune.registry import Recipe, register_recipe
from qkv.finetune.settings import FinetuneSettings

METRICS = {"macro_f1": "max", "accuracy": "max"}  # the first selects the best checkpoint


@dataclass(kw_only=True)
class ClassifySettings(FinetuneSettings):
    RECIPE = "classify"
    TOO_LONG = ("truncate", "error")

    too_long: str = "truncate"
    text_column: str = setting("text", "column with the text")
    text_pair_column: str | None = setting(None, "column with the second text of a pair (optional)")
    label_column: str = setting("label", "column with the label, a name or an id")


# -- metrics --------------------------------------------------------------------------------------------
def confusion(gold: list[int], pred: list[int], n: int) -> list[list[int]]:
    """m[g][p] = examples of class g predicted as p."""
    m = [[0] * n for _ in range(n)]
    for g, p in zip(gold, pred):
        m[g][p] += 1
    return m


def scores(gold: list[int], pred: list[int], n: int) -> dict[str, float]:
    """Accuracy and macro-F1: the unweighted mean over classes of 2TP / (2TP + FP + FN), over the classes
    that occur in the gold labels or the predictions (scikit-learn's f1_score(average="macro"))."""
    m = confusion(gold, pred, n)
    f1s = []
    for c in range(n):
        tp = m[c][c]
        fn = sum(m[c]) - tp
        fp = sum(m[g][c] for g in range(n)) - tp
        if tp + fn + fp:
            f1s.append(2 * tp / (2 * tp + fp + fn))
    acc = sum(m[c][c] for c in range(n)) / max(1, len(gold))
    return {"accuracy": acc, "macro_f1": sum(f1s) / max(1, len(f1s))}


def plot_confusion(m: list[list[int]], names: list[str], path: Path, title: str) -> None:
    import matplotlib  # noqa: PLC0415  (matplotlib: slow to import, only for plots)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    n = len(names)
    fig, ax = plt.subplots(figsize=(1.2 + 0.6 * n, 1.0 + 0.6 * n))
    ax.imshow(m, cmap="Blues")
    ax.set_xticks(range(n), names, rotation=45, ha="right")
    ax.set_yticks(range(n), names)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title)
    top = max(max(r) for r in m) or 1
    for g in range(n):
        for p in range(n):
            ax.text(p, g, str(m[g][p]), ha="center", va="center",
                    color="white" if m[g][p] > top / 2 else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- labels ---------------------------------------------------------------------------------------------
def label_set(values: list[Any], model_names: dict[int, str] | None) -> tuple[dict[str, int], dict[int, str]]:
    """(label -> id, id -> name). All integers: they are the ids (0..max), named by the folder's id2label when
    it has one for each; otherwise names, given ids in sorted order."""
    as_str = [str(v).strip() for v in values]
    # "²" is a digit to isdigit, not to int()
    if all(s.lstrip("-").isdigit() and s.isascii() for s in as_str):
        ids = sorted({int(s) for s in as_str})
        if ids[0] < 0:
            raise ConfigError(f"label ids must be >= 0, got {ids[0]}")
        n = ids[-1] + 1
        names = {i: str(i) for i in range(n)}
        given = model_names or {}
        # the folder's names, when it names every id and they are real names (not transformers' LABEL_i)
        if sorted(given) == list(range(n)) and len(set(given.values())) == n and \
                any(v != f"LABEL_{i}" for i, v in given.items()):
            names = {i: str(given[i]) for i in range(n)}
        return {str(i): i for i in range(n)}, names
    names = sorted(set(as_str))
    return {s: i for i, s in enumerate(names)}, dict(enumerate(names))


def label_ids(values: list[Any], mapping: dict[str, int], path: str,
              records: list[tuple[int, Any]]) -> list[int]:
    out = []
    for v, (line, _) in zip(values, records):
        s = str(v).strip()
        if s not in mapping:
            raise ConfigError(f"{path} line {line}: label {s!r} does not occur in the training data "
                              f"(labels: {', '.join(list(mapping)[:20])})")
        out.append(mapping[s])
    return out


def checked_labels(values: list[Any], path: str, records: list[tuple[int, Any]]) -> list[Any]:
    """Labels as strings or integers. JSON gives other types, which str() would turn into classes of their own
    (1 and 1.0 would be '1' and '1.0'; [1] a class '[1]'): a float equal to an integer is that integer (said
    in one warning), any other float, a list, an object or a boolean is an error naming the line."""
    out, floats = [], []
    for v, (line, _) in zip(values, records):
        if isinstance(v, float) and v.is_integer():
            floats.append(line)
            v = int(v)
        elif isinstance(v, bool) or not isinstance(v, (str, int)):
            raise ConfigError(f"{path} line {line}: label {json.dumps(v)[:60]} is a {type(v).__name__}; "
                              f"labels must be strings or integers")
        out.append(v)
    if floats:
        warnings.warn(f"{path}: {len(floats)} label(s) written as floats equal to integers (line {floats[0]} "
                      "first) are read as those integers", stacklevel=2)
    return out


def _examples(path: str, s: ClassifySettings,
              enc: Any) -> tuple[list[Any], list[Any], list[tuple[int, Any]], int]:
    records = read_records(path)
    texts = [str(t) for t in column(path, records, s.text_column, "text")]
    pairs = column(path, records, s.text_pair_column, "text pair")
    pairs = [str(p) for p in pairs] if s.text_pair_column else None
    labels = checked_labels(column(path, records, s.label_column, "label"), path, records)
    encodings, cut = encode(enc.tokenizer, texts, pairs, enc.max_length, s.too_long, path,
                            lines=[line for line, _ in records])
    return encodings, labels, records, cut


# -- the recipe -----------------------------------------------------------------------------------------
class ClassifyRecipe(EncoderRecipe):
    """Text / text-pair classification in the shared encoder phases (qkv.finetune.phases)."""

    name = head = "classify"
    settings = ClassifySettings

    def setup_data(self) -> EncodedData:
        s, enc = self.s, self.enc
        train_enc, train_raw, train_rec, self.cut = _examples(s.data, s, enc)
        folder_names = {int(k): v for k, v in (enc.hf_config.get("id2label") or {}).items()}
        mapping, self.id2label = label_set(train_raw, folder_names)
        train_y = label_ids(train_raw, mapping, s.data, train_rec)
        self.n_labels = len(self.id2label)
        if self.n_labels < 2:
            raise ConfigError(f"{s.data}: only one label ({self.id2label[0]!r}); classification needs at "
                              "least two")
        types = enc.model.config.type_vocab_size > 1  # one type (RoBERTa): the model's default zeros
        self.train_data = EncodedData(train_enc, train_y, enc.pad_id, s.seed, METRICS, token_types=types)
        self.dev_cut = 0
        if s.dev:
            dev_enc, dev_raw, dev_rec, self.dev_cut = _examples(s.dev, s, enc)
            self.dev = EncodedData(dev_enc, label_ids(dev_raw, mapping, s.dev, dev_rec), enc.pad_id, s.seed,
                                   token_types=types)
        return self.train_data

    def evaluate(self, model: Any) -> dict[str, float]:
        pred = [int(x.argmax()) for x in predict(model, self.dev)]
        return scores(self.dev.labels, pred, self.n_labels)

    def results(self) -> dict[str, Any]:
        """The results, and with --dev the exported model's scores and confusion matrix
        (OUT/confusion.png)."""
        summary, out, n = self.summary, self.s.out, self.n_labels
        result: dict[str, Any] = {"recipe": "classify", "task": "classify",
                                  "labels": [self.id2label[i] for i in range(n)],
                                  "train_examples": len(self.train_data),
                                  "truncated": {"train": self.cut, "dev": self.dev_cut},
                                  "steps": summary["steps"], "best": summary.get("best_eval"),
                                  "out": str(out)}
        if self.dev is not None:
            pred = [int(x.argmax()) for x in predict(self.model, self.dev)]
            final = scores(self.dev.labels, pred, n)
            m = confusion(self.dev.labels, pred, n)
            plot_confusion(m, result["labels"], out / "confusion.png",
                           f"dev: accuracy {final['accuracy']:.3f}, macro-F1 {final['macro_f1']:.3f}")
            result.update(dev=final, confusion=m)
        return result

    def report(self) -> list[str]:
        r, summary, out = self.result, self.summary, self.s.out
        lines = [f"fine-tuned {self.enc.model_type} for {summary['steps']} steps on {len(self.train_data)} "
                 f"examples ({self.n_labels} labels: {', '.join(r['labels'][:10])})"]
        if self.cut or self.dev_cut:
            lines.append(f"truncated to {self.enc.max_length} tokens: {self.cut} training and {self.dev_cut} "
                         f"dev example(s)")
        if self.dev is not None:
            final = r["dev"]
            which = (f"best checkpoint (step {summary['best_eval']['step']})" if summary.get("best_eval")
                     else "final model")
            lines.append(f"dev ({len(self.dev)} examples, {which}): accuracy {final['accuracy']:.4f}, "
                         f"macro-F1 {final['macro_f1']:.4f}; confusion matrix in {out / 'confusion.png'}")
        lines.append(f"saved {out} (transformers: AutoModelForSequenceClassification.from_pretrained; "
                     "qkv.from_pretrained)")
        return lines


register_recipe(Recipe("classify", ("encoder",), "text / text-pair classification with a BERT-family encoder",
                       ClassifyRecipe))
