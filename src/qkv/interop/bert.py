"""BERT (Hugging Face `BertModel` / `BertForMaskedLM` / `BertForSequenceClassification` / `BertForPreTraining`
folders) -> qkv BERT.

HF BERT is our BERT preset: word + position + token-type embeddings, an embedding LayerNorm, Post-LN blocks
with exact GELU, a tanh pooler on [CLS]. Storage differences handled by the key map:
  - separate query / key / value Linears are concatenated (in that order) into our fused qkv_proj;
  - task models prefix the encoder with 'bert.'; their heads live under 'cls.' / 'classifier.'.
The head is chosen by what the checkpoint holds: cls.predictions.* -> head "mlm", classifier.* -> head
"classify", neither -> head "none" (like BertModel). The pooler is kept iff the file has it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.interop import LOADERS
from qkv.interop.common import expand, load_hf_weights, read_hf_state, require, strip_prefix
from qkv.models.bert import BERT, BERTConfig

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
TYPE_MAP = {"embeddings.token_type_embeddings.weight": "type_emb.weight"}
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


def _normalise_keys(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """'bert.' prefix off; the TF-era LayerNorm names gamma/beta -> weight/bias."""
    state = strip_prefix(state, ("bert.",))
    out = {}
    for k, v in state.items():
        if ".LayerNorm.gamma" in k or ".LayerNorm.beta" in k:
            k = k.replace(".LayerNorm.gamma", ".LayerNorm.weight").replace(".LayerNorm.beta", ".LayerNorm.bias")
        out[k] = v
    return out


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
        require(hf.get("tie_word_embeddings", True), "an MLM head untied from the word embeddings is not supported")
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


def load_bert(folder: Path, hf_config: dict[str, Any]) -> BERT:
    hf_state, source = read_hf_state(folder)
    hf_state = _normalise_keys(hf_state)
    has = hf_state.__contains__
    head = ("mlm" if has("cls.predictions.transform.dense.weight")
            else "classify" if has("classifier.weight") else "none")
    config = config_from_hf(hf_config, head=head, pooler=has("pooler.dense.weight") or head == "classify")
    mapping = expand(ENCODER_MAP, config.n_layers)
    if config.type_vocab_size:
        mapping.update(TYPE_MAP)
    if config.pooler:
        mapping.update(POOLER_MAP)
    if head == "mlm":
        mapping.update(MLM_MAP)
        words = hf_state.get("embeddings.word_embeddings.weight")
        for k, ref in (("cls.predictions.decoder.weight", words),
                       ("cls.predictions.decoder.bias", hf_state.get("cls.predictions.bias"))):
            if k in hf_state and ref is not None:
                require(torch.equal(hf_state[k], ref), f"{source}: {k} is not tied as this loader assumes")
    elif head == "classify":
        mapping.update(CLASSIFY_MAP)
    model = BERT(config)
    load_hf_weights(model, hf_state, mapping, ignore=IGNORE, source=source)
    return model.eval()


LOADERS["bert"] = load_bert

__all__ = ["ENCODER_MAP", "config_from_hf", "load_bert"]
