"""RoBERTa and XLM-RoBERTa (Hugging Face `RobertaModel` / `...ForMaskedLM` / `...ForSequenceClassification` /
`...ForTokenClassification`, model_type roberta or xlm-roberta) -> qkv BERT.

The encoder is BERT's, tensor for tensor (same names under the 'roberta.' prefix). What differs:
  - positions start at padding_idx + 1 (= 2): HF numbers real tokens from there and gives pads the
    padding_idx row; our BERT takes `position_offset` = pad_token_id + 1 and a table of context_length +
    offset rows, so max_position_embeddings 514 is a context of 512 tokens. A left-padded row is shifted
    back by its pads (BERT._offset), which reproduces HF's position ids for contiguous real tokens;
  - one token type (type_vocab_size 1), LayerNorm eps 1e-5 (both read from config.json);
  - the sequence classifier is dense -> tanh -> out_proj on <s>: exactly our pooler (tanh) + classifier,
    so classifier.dense becomes the pooler (RobertaForSequenceClassification has no pooler of its own);
  - the MLM head is lm_head.{dense, layer_norm, decoder (tied), bias}.
XLM-RoBERTa is the same architecture under another model_type; the folder's model_type is kept on export.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from qkv.interop.bert import (
    ENCODER_MAP,
    POOLER_MAP,
    TYPE_MAP,
    Layout,
    export_encoder,
    load_encoder,
    write_encoder,
)
from qkv.interop.bert import config_from_hf as bert_config_from_hf
from qkv.interop.bert import config_to_hf as bert_config_to_hf
from qkv.interop.common import require
from qkv.interop.registry import ModelType, register
from qkv.models.bert import BERT, BERTConfig

MLM_MAP = {
    "lm_head.dense.weight": "mlm_dense.weight",
    "lm_head.dense.bias": "mlm_dense.bias",
    "lm_head.layer_norm.weight": "mlm_norm.weight",
    "lm_head.layer_norm.bias": "mlm_norm.bias",
    "lm_head.bias": "mlm_decoder.bias",  # the decoder weight is tied to the word embeddings
}
CLASSIFY_MAP = {
    "classifier.dense.weight": "pooler.weight",
    "classifier.dense.bias": "pooler.bias",
    "classifier.out_proj.weight": "classifier.weight",
    "classifier.out_proj.bias": "classifier.bias",
}
TAG_MAP = {"classifier.weight": "classifier.weight", "classifier.bias": "classifier.bias"}
IGNORE = (
    "embeddings.position_ids",
    "embeddings.token_type_ids",
    "lm_head.decoder.weight",
    "lm_head.decoder.bias",
)


def config_from_hf(hf: dict[str, Any], *, head: str = "none", pooler: bool = True) -> BERTConfig:
    pad = hf.get("pad_token_id", 1)
    require(isinstance(pad, int) and pad >= 0, f"RoBERTa pad_token_id must be a token id, got {pad!r}")
    offset = pad + 1
    n_pos = hf.get("max_position_embeddings", 514)
    require(
        n_pos > offset,
        f"RoBERTa max_position_embeddings {n_pos} leaves no position after the offset {offset}",
    )
    c = bert_config_from_hf({"layer_norm_eps": 1e-5, "type_vocab_size": 1, **hf}, head=head, pooler=pooler)
    c.context_length, c.position_offset, c.pad_token_id = n_pos - offset, offset, pad
    c.validate()
    return c


def config_to_hf(c: BERTConfig) -> dict[str, Any]:
    require(c.position_offset >= 1 and c.pad_token_id == c.position_offset - 1,
            "a RoBERTa folder needs position_offset = pad_token_id + 1")
    return {**bert_config_to_hf(c), "pad_token_id": c.pad_token_id}


ROBERTA_LAYOUT = Layout(
    model_type="roberta",
    prefix="roberta.",
    encoder=ENCODER_MAP,
    types=TYPE_MAP,
    pooler=POOLER_MAP,
    heads={"mlm": MLM_MAP, "classify": CLASSIFY_MAP, "tag": TAG_MAP},
    detect=(
        ("mlm", ("lm_head.dense.weight",)),
        ("classify", ("classifier.dense.weight",)),
        ("tag", ("classifier.weight",)),
    ),
    architectures={
        "none": "RobertaModel",
        "classify": "RobertaForSequenceClassification",
        "tag": "RobertaForTokenClassification",
        "mlm": "RobertaForMaskedLM",
    },
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    ignore=IGNORE,
    tied={
        "lm_head.decoder.weight": "embeddings.word_embeddings.weight",
        "lm_head.decoder.bias": "lm_head.bias",
    },
)
XLM_ROBERTA_LAYOUT = Layout(**{**ROBERTA_LAYOUT.__dict__, "model_type": "xlm-roberta", "architectures": {
    h: a.replace("Roberta", "XLMRoberta") for h, a in ROBERTA_LAYOUT.architectures.items()}})


def load_roberta(folder: Path, hf_config: dict[str, Any]) -> BERT:
    layout = XLM_ROBERTA_LAYOUT if hf_config.get("model_type") == "xlm-roberta" else ROBERTA_LAYOUT
    return load_encoder(folder, hf_config, layout)


def export_roberta(model: BERT, path: str | os.PathLike, *, xlm: bool = False, **kwargs: Any) -> Path:
    return export_encoder(model, path, XLM_ROBERTA_LAYOUT if xlm else ROBERTA_LAYOUT, **kwargs)


register(ModelType("roberta", "encoder", "bert", load_roberta, write_encoder, layout=ROBERTA_LAYOUT),
         ModelType("xlm-roberta", "encoder", "bert", load_roberta, write_encoder, layout=XLM_ROBERTA_LAYOUT))

__all__ = ["ROBERTA_LAYOUT", "XLM_ROBERTA_LAYOUT", "config_from_hf", "export_roberta", "load_roberta"]
