"""What the encoder recipes (classify, tag, mlm) and `qkv embed` share: a BERT-family folder with its
tokenizer, texts encoded (cut or refused at the context), padded batches, the Trainer's defaults, and the
export back to a Hugging Face folder.

Not a recipe itself (it registers nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import qkv
from qkv.config import ConfigError
from qkv.interop.bert import encoder_layout, export_encoder
from qkv.interop.export_tokenizer import copy_tokenizer_files
from qkv.interop.registry import model_types, names
from qkv.interop.tokenizer import HFTokenizer
from qkv.storage import read_config
from qkv.tasks.tokenizers import BPETokenizer, find_tokenizer
from qkv.train import checkpoint as ckpt


# -- the model folder ------------------------------------------------------------------------------------
@dataclass
class EncoderFolder:
    path: Path
    model: Any  # qkv BERT as loaded (any head)
    tokenizer: Any  # a `tokenizers` Tokenizer (or its BertWordPiece wrapper)
    hf_config: dict[str, Any]
    model_type: str

    @property
    def pad_id(self) -> int:
        pad = self.hf_config.get("pad_token_id")
        return int(pad) if isinstance(pad, int) else 0

    @property
    def max_length(self) -> int:
        return int(self.model.config.context_length)

    def layout(self) -> Any:
        return encoder_layout(self.model_type)


def open_encoder(folder: str | Path) -> EncoderFolder:
    """A Hugging Face BERT / RoBERTa / XLM-R / DistilBERT / DeBERTa-v2/v3 folder and its tokenizer
    (tokenizer.json, else vocab.txt), found by the library's one lookup
    (qkv.tasks.tokenizers.find_tokenizer)."""
    folder = Path(folder)
    meta = read_config(folder)
    mt = meta.get("model_type")
    encoders = names(model_types(kind="encoder"))  # each with the Layout that reads and writes it
    if mt not in encoders:
        raise ConfigError(
            f"{folder}: the encoder recipes take a Hugging Face {'/'.join(encoders)} folder; "
            f"this one has model_type {mt!r}" + (" (a qkv checkpoint)" if "qkv_family" in meta else "")
        )
    model = qkv.from_pretrained(folder)
    found = find_tokenizer(folder)
    # the `tokenizers` object inside (batches with offsets and truncation): a folder's tokenizer.json or
    # vocab.txt (HFTokenizer), or a tokenizer.json that qkv's BPE wrapper accepted
    tok = (found.tokenizer if isinstance(found, HFTokenizer)
           else found.hf if isinstance(found, BPETokenizer) else None)
    if tok is None:
        spm = [n for n in ("spm.model", "sentencepiece.bpe.model") if (folder / n).is_file()]
        # a SentencePiece-only upload (DeBERTa-v3's spm.model, some XLM-R): transformers converts it once
        hint = (f"; it has only the SentencePiece model {spm[0]}: write tokenizer.json once with "
                f"transformers, AutoTokenizer.from_pretrained(folder).save_pretrained(folder)") if spm else ""
        raise ConfigError(f"{folder} has no Hugging Face tokenizer (tokenizer.json or vocab.txt){hint}")
    tok.no_truncation()  # a saved tokenizer.json may carry its own settings: lengths are ours to decide
    tok.no_padding()
    return EncoderFolder(folder, model, tok, meta, mt)


def export_folder(enc: EncoderFolder, model: Any, out: Path, id2label: dict[int, str] | None) -> Path:
    """`model` as a Hugging Face folder of the source's family, with the source's tokenizer files."""
    export_encoder(model, out, enc.layout(), base_config=enc.hf_config, id2label=id2label)
    # a classifier or tagger does not generate: a generation_config.json beside it would describe no use of it
    copy_tokenizer_files(enc.path, out, generation=False)
    return out


def new_head_model(enc: EncoderFolder, head: str, num_labels: int, seed: int) -> Any:
    """The folder's model class (BERT, or DeBERTa) with `head` (classify: the pooler kept or added; tag: per
    token) over the folder's encoder. Seeded before building so the new head's initial weights are the same
    in every run."""
    cfg = replace(enc.model.config, head=head, num_labels=num_labels,
                  pooler=head == "classify" or (head != "tag" and enc.model.config.pooler))
    torch.manual_seed(seed)
    model = type(enc.model)(cfg)
    own = model.state_dict()
    src = {k: v for k, v in enc.model.state_dict().items()
           if k in own and own[k].shape == v.shape and not k.startswith(("classifier.", "mlm_"))}
    model.load_state_dict(src, strict=False)
    return model


# -- encoded data -----------------------------------------------------------------------------------------
def encode(tokenizer: Any, texts: list[Any], pairs: list[Any] | None, max_length: int, too_long: str,
           source: str, *, pretokenized: bool = False,
           lines: list[int] | None = None) -> tuple[list[Any], int]:
    """Encodings with the tokenizer's special tokens; texts longer than `max_length` tokens are cut
    (longest_first for pairs) and counted, or, with too_long="error", refused naming the first one (by its
    line in `source` when `lines` gives each text's line, else by its position)."""
    items = list(zip(texts, pairs)) if pairs is not None else texts
    full = tokenizer.encode_batch(items, is_pretokenized=pretokenized)
    long_rows = [i for i, e in enumerate(full) if len(e.ids) > max_length]
    if long_rows and too_long == "error":
        i = long_rows[0]
        # "FILE line N: ..." like every other data error, when the caller knows the lines
        where, first = (f"{source} line {lines[i]}", "this is the first") if lines is not None else \
            (source, f"the first is example {i + 1}")
        raise ConfigError(f"{where}: {len(long_rows)} example(s) longer than the model's context of "
                          f"{max_length} tokens ({first}, {len(full[i].ids)} tokens); shorten them or pass "
                          "--too-long truncate")
    if long_rows:
        tokenizer.enable_truncation(max_length, strategy="longest_first")
        try:
            cut = tokenizer.encode_batch([items[i] for i in long_rows], is_pretokenized=pretokenized)
        finally:
            tokenizer.no_truncation()
        for i, e in zip(long_rows, cut):
            full[i] = e
    return full, len(long_rows)


def pad_batch(rows: list[list[int]], pad: int, dtype: torch.dtype = torch.long) -> Tensor:
    T = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (T - len(r)) for r in rows], dtype=dtype)


class EncodedData:
    """A batch source over encoded examples: a fresh permutation each epoch (from the seed: the same order in
    every run and on resume), each batch padded to its longest row. `labels` per example: an int (a class)
    or a list of ints, one per token (-100 where none)."""

    def __init__(self, encodings: list[Any], labels: list[Any], pad_id: int, seed: int,
                 metrics: dict[str, str] | None = None, token_types: bool = True) -> None:
        if not encodings:
            raise ConfigError("no training examples")
        self.encodings, self.labels, self.pad_id, self.seed = encodings, labels, pad_id, seed
        self.metrics = metrics or {}
        self.token_types = token_types
        self._order: dict[int, Tensor] = {}

    def __len__(self) -> int:
        return len(self.encodings)

    def _perm(self, epoch: int) -> Tensor:
        if epoch not in self._order:
            self._order = {
                epoch: torch.randperm(len(self), generator=torch.Generator().manual_seed(self.seed + epoch))
            }
        return self._order[epoch]

    def rows(self, idx: list[int]) -> dict[str, Tensor]:
        encs = [self.encodings[i] for i in idx]
        batch = {"input_ids": pad_batch([e.ids for e in encs], self.pad_id),
                 "attention_mask": pad_batch([e.attention_mask for e in encs], 0)}
        if self.token_types:
            batch["token_type_ids"] = pad_batch([e.type_ids for e in encs], 0)
        labels = [self.labels[i] for i in idx]
        if labels and isinstance(labels[0], list):
            batch["labels"] = pad_batch(labels, -100)
        else:
            batch["labels"] = torch.tensor(labels, dtype=torch.long)
        return batch

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, Tensor]:
        n = len(self)
        start = index * batch_size
        idx = []
        for k in range(start, start + batch_size):  # an epoch boundary inside a batch continues with the next
            epoch, pos = divmod(k, n)
            idx.append(int(self._perm(epoch)[pos]))
        return self.rows(idx)


def predict(model: Any, data: EncodedData, batch_size: int = 64) -> list[Tensor]:
    """Logits of every example, in order (eval mode, no grad, on the model's device)."""
    device = next(model.parameters()).device
    out = []
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for s in range(0, len(data), batch_size):
                b = data.rows(list(range(s, min(s + batch_size, len(data)))))
                b = {k: v.to(device) for k, v in b.items() if k != "labels"}
                logits = model(**b).logits.float().cpu()
                out.extend(logits.unbind(0))
    finally:
        model.train(was)
    return out


# BERT-style fine-tuning defaults (Devlin et al. 2019, HF run_glue): AdamW 0.9/0.999, warmup then linear decay
FINETUNE_DEFAULTS = {"lr": 3e-5, "schedule": "linear", "warmup": 0.06, "weight_decay": 0.01,
                     "betas": [0.9, 0.999], "batch_size": 16, "clip_grad": 1.0, "log_every": 10,
                     "keep_last": 1}


def best_state(out: Path) -> dict[str, Tensor] | None:
    """The weights of OUT/checkpoints/best, when the run kept one."""
    folder = Path(out) / "checkpoints" / ckpt.BEST
    if not (folder / "model.safetensors").is_file():
        return None
    return ckpt.read_checkpoint(folder)[0]


__all__ = ["FINETUNE_DEFAULTS", "EncodedData", "EncoderFolder", "best_state", "encode", "export_folder",
           "new_head_model", "open_encoder", "predict"]
