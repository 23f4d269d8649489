"""DistilBERT (Hugging Face `DistilBertModel` / `...ForMaskedLM` / `...ForSequenceClassification` /
`...ForTokenClassification`, model_type distilbert) -> qkv BERT.

DistilBERT is BERT with half the layers, no token types and no pooler, under other names:
  transformer.layer.N.attention.{q,k,v,out}_lin  -> our fused qkv_proj / out_proj
  sa_layer_norm / ffn.lin1 / ffn.lin2 / output_layer_norm -> norm1 / ffn.up / ffn.down / norm2 (Post-LN)
  config: dim, hidden_dim, n_layers, n_heads, activation, dropout, attention_dropout; LayerNorm eps 1e-12.
The sequence classifier is pre_classifier -> ReLU -> dropout -> classifier on [CLS]: our pooler with
pooler_act="relu" + classifier. Position embeddings are read as stored: a folder made with
sinusoidal_pos_embds=true holds the sinusoids in the same tensor (HF freezes them; fine-tuning here trains
them, so the exporter writes sinusoidal_pos_embds=false and the learned values).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from qkv.interop.bert import ACTIVATIONS, HF_ACT, Layout, export_encoder, load_encoder, write_encoder
from qkv.interop.common import require
from qkv.interop.registry import ModelType, register
from qkv.models.bert import BERT, BERTConfig

ENCODER_MAP = {
    "embeddings.word_embeddings.weight": "tok_emb.weight",
    "embeddings.position_embeddings.weight": "encoder.position.weight",
    "embeddings.LayerNorm.weight": "encoder.embed_norm.weight",
    "embeddings.LayerNorm.bias": "encoder.embed_norm.bias",
    "transformer.layer.{}.attention.q_lin.weight": "encoder.blocks.{}.attn.qkv_proj.weight",
    "transformer.layer.{}.attention.k_lin.weight": "encoder.blocks.{}.attn.qkv_proj.weight",
    "transformer.layer.{}.attention.v_lin.weight": "encoder.blocks.{}.attn.qkv_proj.weight",
    "transformer.layer.{}.attention.q_lin.bias": "encoder.blocks.{}.attn.qkv_proj.bias",
    "transformer.layer.{}.attention.k_lin.bias": "encoder.blocks.{}.attn.qkv_proj.bias",
    "transformer.layer.{}.attention.v_lin.bias": "encoder.blocks.{}.attn.qkv_proj.bias",
    "transformer.layer.{}.attention.out_lin.weight": "encoder.blocks.{}.attn.out_proj.weight",
    "transformer.layer.{}.attention.out_lin.bias": "encoder.blocks.{}.attn.out_proj.bias",
    "transformer.layer.{}.sa_layer_norm.weight": "encoder.blocks.{}.norm1.weight",
    "transformer.layer.{}.sa_layer_norm.bias": "encoder.blocks.{}.norm1.bias",
    "transformer.layer.{}.ffn.lin1.weight": "encoder.blocks.{}.ffn.up.weight",
    "transformer.layer.{}.ffn.lin1.bias": "encoder.blocks.{}.ffn.up.bias",
    "transformer.layer.{}.ffn.lin2.weight": "encoder.blocks.{}.ffn.down.weight",
    "transformer.layer.{}.ffn.lin2.bias": "encoder.blocks.{}.ffn.down.bias",
    "transformer.layer.{}.output_layer_norm.weight": "encoder.blocks.{}.norm2.weight",
    "transformer.layer.{}.output_layer_norm.bias": "encoder.blocks.{}.norm2.bias",
}
MLM_MAP = {
    "vocab_transform.weight": "mlm_dense.weight",
    "vocab_transform.bias": "mlm_dense.bias",
    "vocab_layer_norm.weight": "mlm_norm.weight",
    "vocab_layer_norm.bias": "mlm_norm.bias",
    "vocab_projector.bias": "mlm_decoder.bias",  # the projector's weight is tied to the word embeddings
}
CLASSIFY_MAP = {
    "pre_classifier.weight": "pooler.weight",
    "pre_classifier.bias": "pooler.bias",
    "classifier.weight": "classifier.weight",
    "classifier.bias": "classifier.bias",
}
TAG_MAP = {"classifier.weight": "classifier.weight", "classifier.bias": "classifier.bias"}
IGNORE = ("embeddings.position_ids", "vocab_projector.weight")


def config_from_hf(hf: dict[str, Any], *, head: str = "none", pooler: bool = False) -> BERTConfig:
    act = hf.get("activation", "gelu")
    require(isinstance(act, str) and act in ACTIVATIONS,
            f"DistilBERT activation {act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    if head == "mlm":
        require(
            act == "gelu", f"a DistilBERT MLM head with activation {act!r} is not supported (only 'gelu')"
        )
        require(
            hf.get("tie_word_embeddings", True),
            "an MLM head untied from the word embeddings is not supported",
        )
    num_labels = len(hf["id2label"]) if isinstance(hf.get("id2label"), dict) else hf.get("num_labels", 2)
    dim = hf.get("dim", 768)
    return BERTConfig(
        vocab_size=hf.get("vocab_size", 30522),
        n_layers=hf.get("n_layers", 6),
        d_model=dim,
        n_heads=hf.get("n_heads", 12),
        d_ff=hf.get("hidden_dim", 4 * dim),
        context_length=hf.get("max_position_embeddings", 512),
        type_vocab_size=0,
        ffn=ACTIVATIONS[act],
        norm_eps=1e-12,
        dropout=float(hf.get("dropout", 0.1)),
        attn_dropout=float(hf.get("attention_dropout", 0.1)),
        init_std=float(hf.get("initializer_range", 0.02)),
        pooler=pooler,
        pooler_act="relu",
        head=head,
        num_labels=num_labels,
        pad_token_id=hf.get("pad_token_id", 0),
    )


def config_to_hf(c: BERTConfig) -> dict[str, Any]:
    require(c.type_vocab_size == 0 and c.position_offset == 0 and c.norm_eps == 1e-12,
            "a DistilBERT folder has no token types, no position offset and LayerNorm eps 1e-12")
    return {
        "vocab_size": c.vocab_size,
        "dim": c.d_model,
        "n_layers": c.n_layers,
        "n_heads": c.n_heads,
        "hidden_dim": c.d_ff or 4 * c.d_model,
        "activation": HF_ACT[c.ffn],
        "max_position_embeddings": c.context_length,
        "dropout": c.dropout,
        "attention_dropout": c.attn_dropout,
        "initializer_range": c.init_std,
        "sinusoidal_pos_embds": False,
    }


DISTILBERT_LAYOUT = Layout(
    model_type="distilbert", prefix="distilbert.", encoder=ENCODER_MAP, types={}, pooler={},
    heads={"mlm": MLM_MAP, "classify": CLASSIFY_MAP, "tag": TAG_MAP},
    detect=(("mlm", ("vocab_transform.weight",)), ("classify", ("pre_classifier.weight",)),
            ("tag", ("classifier.weight",))),
    architectures={"none": "DistilBertModel", "classify": "DistilBertForSequenceClassification",
                   "tag": "DistilBertForTokenClassification", "mlm": "DistilBertForMaskedLM"},
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, ignore=IGNORE,
    tied={"vocab_projector.weight": "embeddings.word_embeddings.weight"}, pooler_act="relu",
    fields={"n_layers": "n_layers", "vocab_size": "vocab_size", "d_model": "dim",
            "context_length": "max_position_embeddings", "d_ff": "hidden_dim"},
)


def load_distilbert(folder: Path, hf_config: dict[str, Any]) -> BERT:
    return load_encoder(folder, hf_config, DISTILBERT_LAYOUT)


def export_distilbert(model: BERT, path: str | os.PathLike, **kwargs: Any) -> Path:
    return export_encoder(model, path, DISTILBERT_LAYOUT, **kwargs)


register(ModelType("distilbert", "encoder", "bert", load_distilbert, write_encoder, layout=DISTILBERT_LAYOUT))

__all__ = ["DISTILBERT_LAYOUT", "config_from_hf", "export_distilbert", "load_distilbert"]
