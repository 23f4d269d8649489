"""BERT (Hugging Face `BertModel` / `BertForMaskedLM` / `BertForSequenceClassification` / `BertForPreTraining`
folders) -> qkv BERT.

HF BERT is our BERT preset: word + position + token-type embeddings, an embedding LayerNorm, Post-LN blocks
with exact GELU, a tanh pooler on [CLS]. Storage differences handled by the key map:
  - separate query / key / value Linears are concatenated (in that order) into our fused qkv_proj;
  - task models prefix the encoder with 'bert.'; their heads live under 'cls.' / 'classifier.'.
The head is chosen by what the checkpoint holds: cls.predictions.* -> head "mlm", classifier.* with a pooler
-> head "classify", classifier.* without one (BertForTokenClassification) -> head "tag", neither -> head
"none" (like BertModel). The pooler is kept iff the file has it.

RoBERTa / XLM-R (interop/roberta.py) and DistilBERT (interop/distilbert.py) are the same encoder with other
names; each describes itself as a `Layout` (below), and one loader and one exporter serve all three.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qkv.interop.common import (
    HFTensors,
    build_skeleton,
    check_sizes,
    expand,
    export_state,
    load_hf_weights,
    require,
    unlike,
    write_hf_folder,
)
from qkv.interop.registry import ExportRequest, ModelType, lookup, register
from qkv.models.bert import BERT, BERTConfig
from qkv.storage import unwrap

# a layer after its self-attention: the same keys in BERT and DeBERTa
BLOCK_OUTPUT_MAP = {
    "encoder.layer.{}.attention.output.dense.weight": "encoder.blocks.{}.attn.out_proj.weight",
    "encoder.layer.{}.attention.output.dense.bias": "encoder.blocks.{}.attn.out_proj.bias",
    "encoder.layer.{}.attention.output.LayerNorm.weight": "encoder.blocks.{}.norm1.weight",
    "encoder.layer.{}.attention.output.LayerNorm.bias": "encoder.blocks.{}.norm1.bias",
    "encoder.layer.{}.intermediate.dense.weight": "encoder.blocks.{}.ffn.up.weight",
    "encoder.layer.{}.intermediate.dense.bias": "encoder.blocks.{}.ffn.up.bias",
    "encoder.layer.{}.output.dense.weight": "encoder.blocks.{}.ffn.down.weight",
    "encoder.layer.{}.output.dense.bias": "encoder.blocks.{}.ffn.down.bias",
    "encoder.layer.{}.output.LayerNorm.weight": "encoder.blocks.{}.norm2.weight",
    "encoder.layer.{}.output.LayerNorm.bias": "encoder.blocks.{}.norm2.bias",
}
ENCODER_MAP = {
    "embeddings.word_embeddings.weight": "tok_emb.weight",
    "embeddings.position_embeddings.weight": "encoder.position.weight",
    "embeddings.LayerNorm.weight": "encoder.embed_norm.weight",
    "embeddings.LayerNorm.bias": "encoder.embed_norm.bias",
    # q, k, v -> one fused projection: concatenated along the output dimension in this order
    "encoder.layer.{}.attention.self.query.weight": "encoder.blocks.{}.attn.qkv_proj.weight",
    "encoder.layer.{}.attention.self.key.weight": "encoder.blocks.{}.attn.qkv_proj.weight",
    "encoder.layer.{}.attention.self.value.weight": "encoder.blocks.{}.attn.qkv_proj.weight",
    "encoder.layer.{}.attention.self.query.bias": "encoder.blocks.{}.attn.qkv_proj.bias",
    "encoder.layer.{}.attention.self.key.bias": "encoder.blocks.{}.attn.qkv_proj.bias",
    "encoder.layer.{}.attention.self.value.bias": "encoder.blocks.{}.attn.qkv_proj.bias",
    **BLOCK_OUTPUT_MAP,
}
TYPE_MAP = {"embeddings.token_type_embeddings.weight": "type_emb.weight"}
# our config's sizes -> the config.json fields that give them (named when the weights disagree)
BERT_FIELDS = {"n_layers": "num_hidden_layers", "vocab_size": "vocab_size", "d_model": "hidden_size",
               "context_length": "max_position_embeddings", "d_ff": "intermediate_size",
               "type_vocab_size": "type_vocab_size"}
POOLER_MAP = {"pooler.dense.weight": "pooler.weight", "pooler.dense.bias": "pooler.bias"}
MLM_MAP = {
    "cls.predictions.transform.dense.weight": "mlm_dense.weight",
    "cls.predictions.transform.dense.bias": "mlm_dense.bias",
    "cls.predictions.transform.LayerNorm.weight": "mlm_norm.weight",
    "cls.predictions.transform.LayerNorm.bias": "mlm_norm.bias",
    "cls.predictions.bias": "mlm_decoder.bias",  # the decoder weight is tied to the word embeddings
}
CLASSIFY_MAP = {"classifier.weight": "classifier.weight", "classifier.bias": "classifier.bias"}

# Present in some files, carrying nothing our model needs: index buffers, the decoder's copies of tied
# tensors (checked equal below), and BertForPreTraining's next-sentence head, which qkv does not model.
IGNORE = ("embeddings.position_ids", "embeddings.token_type_ids", "cls.predictions.decoder.weight",
          "cls.predictions.decoder.bias", "cls.seq_relationship.weight", "cls.seq_relationship.bias")

ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def config_from_hf(hf: dict[str, Any], *, head: str = "none", pooler: bool = True) -> BERTConfig:
    """Map a BERT config.json to BERTConfig; refuse the options our BERT does not implement."""
    pos = hf.get("position_embedding_type", "absolute")
    require(pos == "absolute", f"BERT position_embedding_type {pos!r} is not supported (only 'absolute')")
    act = hf.get("hidden_act", "gelu")
    require(isinstance(act, str) and act in ACTIVATIONS,
            f"BERT hidden_act {act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    require(not hf.get("is_decoder", False), "BERT with is_decoder=True is not supported")
    require(not hf.get("add_cross_attention", False), "BERT with add_cross_attention=True is not supported")
    if head == "mlm":
        # our MLM head's transform uses exact GELU; HF's uses hidden_act
        require(act == "gelu", f"a BERT MLM head with hidden_act {act!r} is not supported (only 'gelu')")
        require(
            hf.get("tie_word_embeddings", True),
            "an MLM head untied from the word embeddings is not supported",
        )
    num_labels = len(hf["id2label"]) if isinstance(hf.get("id2label"), dict) else hf.get("num_labels", 2)
    drop = float(hf.get("hidden_dropout_prob", 0.1))
    return BERTConfig(
        vocab_size=hf.get("vocab_size", 30522),
        n_layers=hf.get("num_hidden_layers", 12),
        d_model=hf.get("hidden_size", 768),
        n_heads=hf.get("num_attention_heads", 12),
        d_ff=hf.get("intermediate_size", 3072),
        context_length=hf.get("max_position_embeddings", 512),
        type_vocab_size=hf.get("type_vocab_size", 2),
        ffn=ACTIVATIONS[act],
        norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        dropout=drop,
        attn_dropout=float(hf.get("attention_probs_dropout_prob", 0.1)),
        init_std=float(hf.get("initializer_range", 0.02)),
        pooler=pooler,
        head=head,
        num_labels=num_labels,
    )


@dataclass(frozen=True)
class Layout:
    """How one BERT-family checkpoint names our BERT's tensors.

    Keys are those of the base model (BertModel, RobertaModel, ...); task models put them under `prefix`
    and keep their head outside it. `heads[h]` maps a head's tensors (head "classify" may bring the pooler:
    RoBERTa's classifier.dense, DistilBERT's pre_classifier); `detect` lists (head, the keys that prove it)
    in order of precedence; `pooler_act` is the classify pooler's activation (None: the family's config.json
    names it, and the model's config carries it); `model_class` is the qkv model built (BERT or a
    subclass)."""

    model_type: str
    prefix: str
    encoder: dict[str, str]
    types: dict[str, str]
    pooler: dict[str, str]
    heads: dict[str, dict[str, str]]
    detect: tuple[tuple[str, tuple[str, ...]], ...]
    architectures: dict[str, str]  # head -> HF class written by export
    config_from_hf: Callable[..., BERTConfig]
    config_to_hf: Callable[[BERTConfig], dict[str, Any]]
    ignore: tuple[str, ...] = ()
    tied: dict[str, str] = field(default_factory=dict)  # file key -> the key it must equal (tied decoders)
    pooler_act: str | None = "tanh"
    # our size -> config.json's field
    fields: dict[str, str] = field(default_factory=lambda: dict(BERT_FIELDS))
    model_class: type = BERT
    extra: Callable[[BERTConfig], dict[str, str]] | None = None  # more tensors, as the config decides


def encoder_layout(model_type: str) -> Layout:
    """The Layout of an encoder model_type (its record's)."""
    record = lookup(model_type)
    if record is None or record.layout is None:
        raise ValueError(f"{model_type!r} is not an encoder model_type qkv reads")
    return record.layout


def _normalise_key(key: str, prefix: str) -> str:
    """The task model's prefix off; the TF-era LayerNorm names gamma/beta -> weight/bias."""
    key = key.removeprefix(prefix)
    if ".LayerNorm.gamma" in key or ".LayerNorm.beta" in key:
        key = key.replace(".LayerNorm.gamma", ".LayerNorm.weight").replace(
            ".LayerNorm.beta", ".LayerNorm.bias"
        )
    return key


def _mapping(layout: Layout, config: BERTConfig) -> dict[str, str]:
    mapping = expand(layout.encoder, config.n_layers)
    if config.type_vocab_size:
        mapping.update(layout.types)
    head_map = layout.heads.get(config.head, {})
    if config.pooler and not any(v.startswith("pooler.") for v in head_map.values()):
        mapping.update(layout.pooler)
    mapping.update(head_map)
    if layout.extra is not None:
        mapping.update(layout.extra(config))
    return mapping


def _check_sizes(hf_state: HFTensors, source: str, layout: Layout, c: BERTConfig) -> None:
    """config.json's sizes against the file's shapes, before the key map is expanded or the model built."""
    key = {ours: hf for hf, ours in {**layout.encoder, **layout.types}.items()}  # our key -> the file's
    f = layout.fields
    check_sizes(
        hf_state,
        source,
        [
            (f["n_layers"], c.n_layers, key["encoder.blocks.{}.norm1.weight"], None),
            (f["vocab_size"], c.vocab_size, key["tok_emb.weight"], 0),
            (f["d_model"], c.d_model, key["tok_emb.weight"], 1),
            # an absolute position table only where the family has one (DeBERTa's positions are relative)
            *(
                [
                    (
                        f["context_length"],
                        c.context_length + c.position_offset,
                        key["encoder.position.weight"],
                        0,
                    )
                ]
                if "encoder.position.weight" in key
                else []
            ),
            (f["d_ff"], c.d_ff or 4 * c.d_model, key["encoder.blocks.{}.ffn.up.weight"].format(0), 0),
            *([(f["type_vocab_size"], c.type_vocab_size, key["type_emb.weight"], 0)] if layout.types else []),
        ],
    )


def load_encoder(folder: Path, hf_config: dict[str, Any], layout: Layout) -> BERT:
    """Any BERT-family folder -> our BERT, with the head the file holds (a bf16 or fp16 file keeps its
    dtype)."""
    hf_state = HFTensors(folder)  # names, shapes and dtypes now; each tensor read when it is copied
    source = hf_state.source
    hf_state.rename(lambda k: _normalise_key(k, layout.prefix))
    head = next((h for h, keys in layout.detect if all(k in hf_state for k in keys)), "none")
    has_pooler = any(k in hf_state for k in layout.pooler)
    config = layout.config_from_hf(hf_config, head=head, pooler=has_pooler or head == "classify")
    _check_sizes(hf_state, source, layout, config)
    tied = {k: (ref, f"{source}: {k} is not tied as this loader assumes") for k, ref in layout.tied.items()}
    # parameters on meta: storage comes in the file's dtype
    model = build_skeleton(lambda: layout.model_class(config))
    load_hf_weights(model, hf_state, _mapping(layout, config), ignore=layout.ignore, source=source, tied=tied)
    return model.eval()


def export_encoder(
    model: BERT,
    path: str | os.PathLike,
    layout: Layout,
    *,
    base_config: dict[str, Any] | None = None,
    id2label: dict[int, str] | None = None,
) -> Path:
    """Write `model` as a Hugging Face folder of `layout`'s family (config.json + model.safetensors):
    the base model for head "none", XForSequenceClassification for "classify", XForTokenClassification for
    "tag". base_config: the config.json the model was loaded from (its token ids, model_type, ... are kept;
    every architecture field is written from our config). id2label: class names, in id order."""
    model = unwrap(model)
    c: BERTConfig = model.config
    require(c.head in layout.architectures, f"exporting a {layout.model_type} with head {c.head!r} is not "
                                            f"supported ({', '.join(layout.architectures)})")
    # transformers' MLM transform applies hidden_act; ours is exact GELU
    require(c.head != "mlm" or c.ffn == "gelu",
            f"a {layout.model_type} MLM head is written for a GELU model; this one's ffn is {c.ffn!r}")
    require(
        layout.pooler_act in (None, c.pooler_act) or c.head != "classify",
        f"a {layout.model_type} classifier pools with {layout.pooler_act}, this model with {c.pooler_act}",
    )
    off = unlike(c, placement="post", norm="layernorm", bias=True, qkv_bias=(None, True), qk_norm=False,
                 n_kv_heads=(None, c.n_heads), head_dim=(None, c.d_model // c.n_heads), scaled=True,
                 ffn=tuple(HF_ACT), position="none" if layout.model_class is not BERT else "learned")
    require(not off, f"a {layout.model_type} folder holds a Post-LN LayerNorm encoder with biases, one "
                     f"key/value head per query head and a {'/'.join(HF_ACT)} FFN; this model has "
                     f"{', '.join(off)}")
    mapping = _mapping(layout, c)
    if c.head in ("tag", "mlm"):  # HF token classifiers and masked LMs have no pooler (and one in a tagger's
        # file would read as "classify")
        mapping = {k: v for k, v in mapping.items() if not v.startswith("pooler.")}
    state = export_state(model.state_dict(), mapping)
    head_keys = set(layout.heads.get(c.head, {}))
    if c.head != "none":
        state = {(k if k in head_keys else layout.prefix + k): v for k, v in state.items()}
    dropped = ("architectures", "id2label", "label2id", "num_labels", "_name_or_path", "transformers_version",
               "torch_dtype", "dtype")
    hf = {k: v for k, v in (base_config or {}).items() if k not in dropped}
    hf.setdefault("model_type", layout.model_type)
    hf.update(layout.config_to_hf(c))
    hf["architectures"] = [layout.architectures[c.head]]
    if c.head in ("classify", "tag"):
        names = id2label or {i: f"LABEL_{i}" for i in range(c.num_labels)}
        require(len(names) == c.num_labels, f"id2label has {len(names)} names for {c.num_labels} labels")
        hf["id2label"] = {str(i): str(n) for i, n in sorted(names.items())}
        hf["label2id"] = {str(n): int(i) for i, n in sorted(names.items())}
    return write_hf_folder(path, state, hf)


HF_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def config_to_hf(c: BERTConfig) -> dict[str, Any]:
    """The architecture fields of a BertConfig (the inverse of config_from_hf)."""
    return {
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "intermediate_size": c.d_ff or 4 * c.d_model,
        "hidden_act": HF_ACT[c.ffn], "max_position_embeddings": c.context_length + c.position_offset,
        "type_vocab_size": c.type_vocab_size, "layer_norm_eps": c.norm_eps,
        "hidden_dropout_prob": c.dropout, "attention_probs_dropout_prob": c.attn_dropout,
        "initializer_range": c.init_std, "position_embedding_type": "absolute",
    }


BERT_LAYOUT = Layout(
    model_type="bert", prefix="bert.", encoder=ENCODER_MAP, types=TYPE_MAP, pooler=POOLER_MAP,
    heads={"mlm": MLM_MAP, "classify": CLASSIFY_MAP, "tag": CLASSIFY_MAP},
    # classifier.* beside a pooler: BertForSequenceClassification; without one: BertForTokenClassification
    detect=(("mlm", ("cls.predictions.transform.dense.weight",)),
            ("classify", ("classifier.weight", "pooler.dense.weight")), ("tag", ("classifier.weight",))),
    architectures={"none": "BertModel", "classify": "BertForSequenceClassification",
                   "tag": "BertForTokenClassification", "mlm": "BertForMaskedLM"},
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, ignore=IGNORE,
    tied={"cls.predictions.decoder.weight": "embeddings.word_embeddings.weight",
          "cls.predictions.decoder.bias": "cls.predictions.bias"},
)


def load_bert(folder: Path, hf_config: dict[str, Any]) -> BERT:
    return load_encoder(folder, hf_config, BERT_LAYOUT)


def export_bert(model: BERT, path: str | os.PathLike, **kwargs: Any) -> Path:
    return export_encoder(model, path, BERT_LAYOUT, **kwargs)


def write_encoder(model: BERT, out: Path, request: ExportRequest) -> None:
    """Any encoder model_type's exporter: config.json's other fields from the source folder's (a Hugging Face
    one); the class names the request gives, else the source's, numbered when they do not fit the head."""
    base = request.base_config()
    names = (base or {}).get("id2label")
    id2label = request.labels or ({int(i): str(n) for i, n in names.items()} if isinstance(names, dict)
                                  else None)
    if id2label is not None and len(id2label) != getattr(model.config, "num_labels", None):
        id2label = None
    export_encoder(model, out, encoder_layout(request.model_type), base_config=base, id2label=id2label)


register(ModelType("bert", "encoder", "bert", load_bert, write_encoder, layout=BERT_LAYOUT))

__all__ = ["BERT_LAYOUT", "ENCODER_MAP", "Layout", "config_from_hf", "config_to_hf", "encoder_layout",
           "export_bert", "export_encoder", "load_bert", "load_encoder"]
