"""DeBERTa-v2/v3 (Hugging Face `DebertaV2Model` / `DebertaV2ForSequenceClassification` /
`DebertaV2ForTokenClassification`, model_type deberta-v2) -> qkv DeBERTa (models/deberta.py).

The layers are BERT's under other names (query_proj / key_proj / value_proj fused into our qkv_proj) plus
the relative-position table encoder.rel_embeddings and its LayerNorm encoder.LayerNorm. One loader and one
exporter serve the BERT family (interop/bert.py); this file is DeBERTa's `Layout` and its config mapping.

Supported: the configuration of the released v3 models (and v2 without the conv layer): relative_attention
true, position_biased_input false, share_att_key true, pos_att_type any of c2p / p2c, norm_rel_ebd
"layer_norm" or "none", any position_buckets / max_relative_positions, no conv layer, embedding_size =
hidden_size. Other settings are refused naming the field. The pretraining heads a released checkpoint
carries (lm_predictions.*, the RTD discriminator mask_predictions.*) are not loaded: such a folder loads as
the bare encoder, as transformers' task models load it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from qkv.interop.bert import (
    ACTIVATIONS,
    BLOCK_OUTPUT_MAP,
    CLASSIFY_MAP,
    HF_ACT,
    POOLER_MAP,
    TYPE_MAP,
    Layout,
    export_encoder,
    load_encoder,
    write_encoder,
)
from qkv.interop.bert import MLM_MAP as BERT_MLM_MAP
from qkv.interop.common import require
from qkv.interop.registry import ModelType, register
from qkv.models.deberta import DeBERTa, DeBERTaConfig

ENCODER_MAP = {
    "embeddings.word_embeddings.weight": "tok_emb.weight",
    "embeddings.LayerNorm.weight": "embed_norm.weight",
    "embeddings.LayerNorm.bias": "embed_norm.bias",
    "encoder.rel_embeddings.weight": "encoder.position.rel_emb.weight",
    # q, k, v -> one fused projection, concatenated along the output dimension in this order
    "encoder.layer.{}.attention.self.query_proj.weight": "encoder.blocks.{}.attn.qkv_proj.weight",
    "encoder.layer.{}.attention.self.key_proj.weight": "encoder.blocks.{}.attn.qkv_proj.weight",
    "encoder.layer.{}.attention.self.value_proj.weight": "encoder.blocks.{}.attn.qkv_proj.weight",
    "encoder.layer.{}.attention.self.query_proj.bias": "encoder.blocks.{}.attn.qkv_proj.bias",
    "encoder.layer.{}.attention.self.key_proj.bias": "encoder.blocks.{}.attn.qkv_proj.bias",
    "encoder.layer.{}.attention.self.value_proj.bias": "encoder.blocks.{}.attn.qkv_proj.bias",
    **BLOCK_OUTPUT_MAP,
}
REL_NORM_MAP = {"encoder.LayerNorm.weight": "encoder.position.norm.weight",
                "encoder.LayerNorm.bias": "encoder.position.norm.bias"}
# index buffers, an unused absolute position table (position_biased_input=false), the pretraining heads
IGNORE = (
    "embeddings.position_ids",
    "embeddings.position_embeddings.weight",
    "cls.predictions.decoder.weight",  # the MLM decoder: tied to the word embeddings (checked by `tied`)
    "cls.predictions.decoder.bias",
    *(
        f"lm_predictions.lm_head.{k}"
        for k in ("dense.weight", "dense.bias", "LayerNorm.weight", "LayerNorm.bias", "bias")
    ),
    *(
        f"mask_predictions.{k}"
        for k in (
            "dense.weight",
            "dense.bias",
            "LayerNorm.weight",
            "LayerNorm.bias",
            "classifier.weight",
            "classifier.bias",
        )
    ),
)


def _terms(hf: dict[str, Any]) -> tuple[str, ...]:
    """pos_att_type as a list (config.json) or "p2c|c2p" (older configs)."""
    raw = hf.get("pos_att_type") or []
    items = [t.strip().lower() for t in raw.split("|")] if isinstance(raw, str) else list(raw)
    bad = [t for t in items if t not in ("c2p", "p2c")]
    require(not bad, f"DeBERTa pos_att_type {bad[0] if bad else ''!r} is not supported (c2p, p2c)")
    return tuple(items)


def _require_v3_shape(hf: dict[str, Any]) -> None:
    """Refuse, naming the field, what this implementation does not compute."""
    d = hf.get("hidden_size", 1536)
    require(hf.get("relative_attention", False) is True,
            "DeBERTa relative_attention=false is not supported (only the relative-attention models)")
    require(not hf.get("position_biased_input", True),
            "DeBERTa position_biased_input=true (absolute positions added to the input) is not supported")
    require(hf.get("share_att_key", False) is True,
            "DeBERTa share_att_key=false (separate position projections, DeBERTa-v1 style) is not supported")
    require(not hf.get("conv_kernel_size", 0), "DeBERTa conv_kernel_size > 0 (the first layer's convolution) "
                                                "is not supported")
    require(
        hf.get("embedding_size", d) == d,
        "DeBERTa embedding_size != hidden_size (embed_proj) is not supported",
    )
    require(
        hf.get("attention_head_size", d // hf.get("num_attention_heads", 24))
        * hf.get("num_attention_heads", 24)
        == d,
        "DeBERTa attention_head_size * num_attention_heads != hidden_size is not supported",
    )
    require(
        hf.get("pooler_hidden_size", d) == d, "DeBERTa pooler_hidden_size != hidden_size is not supported"
    )
    norms = [x.strip() for x in str(hf.get("norm_rel_ebd", "none")).lower().split("|")]
    require(all(x in ("layer_norm", "none") for x in norms),
            f"DeBERTa norm_rel_ebd {hf.get('norm_rel_ebd')!r} is not supported (layer_norm, none)")


def config_from_hf(hf: dict[str, Any], *, head: str = "none", pooler: bool = True) -> DeBERTaConfig:
    """Map a DebertaV2Config's config.json to DeBERTaConfig (the defaults are DebertaV2Config's)."""
    _require_v3_shape(hf)
    act = hf.get("hidden_act", "gelu")
    require(isinstance(act, str) and act in ACTIVATIONS,
            f"DeBERTa hidden_act {act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    # our MLM head's transform is exact GELU; transformers' applies hidden_act
    require(head != "mlm" or act == "gelu",
            f"a DeBERTa MLM head with hidden_act {act!r} is not supported (only 'gelu')")
    pool_act = hf.get("pooler_hidden_act", "gelu")
    require(pool_act in ("gelu", "tanh", "relu"),
            f"DeBERTa pooler_hidden_act {pool_act!r} is not supported (gelu, tanh, relu)")
    n_pos = hf.get("max_position_embeddings", 512)
    max_rel = hf.get("max_relative_positions", -1)
    buckets = hf.get("position_buckets", -1)
    require(buckets != 1, "DeBERTa position_buckets=1 is not supported (0 or less: none; else >= 2)")
    terms = _terms(hf)
    num_labels = len(hf["id2label"]) if isinstance(hf.get("id2label"), dict) else hf.get("num_labels", 2)
    drop = float(hf.get("hidden_dropout_prob", 0.1))
    cls_drop = hf.get("cls_dropout")
    return DeBERTaConfig(
        vocab_size=hf.get("vocab_size", 128100),
        n_layers=hf.get("num_hidden_layers", 24),
        d_model=hf.get("hidden_size", 1536),
        n_heads=hf.get("num_attention_heads", 24),
        d_ff=hf.get("intermediate_size", 6144),
        context_length=n_pos,
        type_vocab_size=hf.get("type_vocab_size", 0),
        ffn=ACTIVATIONS[act],
        norm_eps=float(hf.get("layer_norm_eps", 1e-7)),
        dropout=drop,
        attn_dropout=float(hf.get("attention_probs_dropout_prob", 0.1)),
        init_std=float(hf.get("initializer_range", 0.02)),
        pooler=pooler,
        pooler_act=pool_act,
        head=head,
        num_labels=num_labels,
        pad_token_id=hf.get("pad_token_id", 0),
        relative_buckets=max(0, buckets),
        max_relative_positions=max_rel if max_rel >= 1 else n_pos,
        c2p="c2p" in terms,
        p2c="p2c" in terms,
        rel_norm="layer_norm" in str(hf.get("norm_rel_ebd", "none")).lower(),
        pooler_dropout=float(hf.get("pooler_dropout", 0.0)),
        cls_dropout=None if cls_drop is None else float(cls_drop),
    )


def config_to_hf(c: DeBERTaConfig) -> dict[str, Any]:
    """The architecture fields of a DebertaV2Config (the inverse of config_from_hf)."""
    return {
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "intermediate_size": c.d_ff or 4 * c.d_model,
        "hidden_act": HF_ACT[c.ffn],
        "max_position_embeddings": c.context_length,
        "type_vocab_size": c.type_vocab_size,
        "layer_norm_eps": c.norm_eps,
        "hidden_dropout_prob": c.dropout,
        "attention_probs_dropout_prob": c.attn_dropout,
        "initializer_range": c.init_std,
        "relative_attention": True,
        "position_biased_input": False,
        "share_att_key": True,
        "pos_att_type": list(c.terms),
        "position_buckets": c.relative_buckets or -1,
        "max_relative_positions": c.max_relative_positions,
        "norm_rel_ebd": "layer_norm" if c.rel_norm else "none",
        "pooler_hidden_size": c.d_model,
        "pooler_hidden_act": c.pooler_act,
        "pooler_dropout": c.pooler_dropout,
        "conv_kernel_size": 0,
        "pad_token_id": c.pad_token_id if c.pad_token_id is not None else 0,
        **({} if c.cls_dropout is None else {"cls_dropout": c.cls_dropout}),
    }


DEBERTA_LAYOUT = Layout(
    model_type="deberta-v2",
    prefix="deberta.",
    encoder=ENCODER_MAP,
    types=TYPE_MAP,
    pooler=POOLER_MAP,
    # DebertaV2ForMaskedLM's head (legacy layout, transformers' default) has BERT's cls.predictions.* keys
    heads={"mlm": BERT_MLM_MAP, "classify": CLASSIFY_MAP, "tag": CLASSIFY_MAP},
    # classifier.* beside a pooler: DebertaV2ForSequenceClassification; without one: ...ForTokenClassification
    detect=(("mlm", ("cls.predictions.transform.dense.weight",)),
            ("classify", ("classifier.weight", "pooler.dense.weight")), ("tag", ("classifier.weight",))),
    architectures={
        "none": "DebertaV2Model",
        "classify": "DebertaV2ForSequenceClassification",
        "tag": "DebertaV2ForTokenClassification",
        "mlm": "DebertaV2ForMaskedLM",
    },
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    ignore=IGNORE,
    pooler_act=None,
    model_class=DeBERTa,
    tied={"cls.predictions.decoder.weight": "embeddings.word_embeddings.weight",
          "cls.predictions.decoder.bias": "cls.predictions.bias"},
    extra=lambda c: REL_NORM_MAP if c.rel_norm else {},
)


def load_deberta(folder: Path, hf_config: dict[str, Any]) -> DeBERTa:
    return load_encoder(folder, hf_config, DEBERTA_LAYOUT)


def export_deberta(model: DeBERTa, path: str | os.PathLike, **kwargs: Any) -> Path:
    return export_encoder(model, path, DEBERTA_LAYOUT, **kwargs)


register(ModelType("deberta-v2", "encoder", "deberta", load_deberta, write_encoder, layout=DEBERTA_LAYOUT))

__all__ = ["DEBERTA_LAYOUT", "config_from_hf", "config_to_hf", "export_deberta", "load_deberta"]
