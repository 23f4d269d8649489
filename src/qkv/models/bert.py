"""BERT-style encoder (Devlin et al. 2019): bidirectional Post-LN blocks over token + position + segment
embeddings, with a pooler on [CLS] and a masked-LM or sequence-classification head.

ids (B, T) -> tok + pos + type embeddings -> LayerNorm -> N Post-LN blocks -> hidden (B, T, d)
           -> mlm head (dense, gelu, LayerNorm, tied decoder) | pooler (tanh dense on [CLS]) -> classifier
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.config import ConfigError, TransformerConfig, setting
from qkv.models.base import ModelOutput, QKVModel, build_stack, token_loss
from qkv.models.registry import register_family, register_preset
from qkv.nn.checks import check_batch, check_labels, check_length, check_token_ids
from qkv.nn.norm import build_norm

# the pooler's activation: BERT's tanh, DistilBERT's relu (pre_classifier), DeBERTa's ContextPooler gelu
POOLER_ACTS = {"tanh": torch.tanh, "relu": torch.relu, "gelu": F.gelu}


@dataclass
class BERTConfig(TransformerConfig):
    vocab_size: int = setting(30522, "token vocabulary", ge=1)
    n_layers: int = setting(12, "encoder blocks", ge=1)
    d_model: int = TransformerConfig.override("d_model", 768)
    n_heads: int = TransformerConfig.override("n_heads", 12)
    context_length: int = setting(512, "longest sequence (positions) the model accepts", ge=1)
    type_vocab_size: int = setting(2, "segment (sentence A/B) embeddings", ge=0, note="0 = none")
    pooler: bool = setting(True, "tanh(W h_[CLS] + b), as in BERT")
    head: Literal["none", "mlm", "classify", "tag"] = setting(
        "none", "none (like BertModel), mlm, classify or tag (one label per token)")
    num_labels: int = setting(2, "classes of the classification (or tagging) head", ge=1)
    pooler_act: str = setting("tanh", "tanh (BERT, RoBERTa's classifier.dense), relu (DistilBERT) or gelu "
                              "(DeBERTa)", choices=tuple(POOLER_ACTS))
    # RoBERTa counts positions from padding_idx + 1 = 2: the learned table then has context_length +
    # position_offset rows, the first position_offset never used by a real token
    position_offset: int = setting(0, "learned position rows before the first real one (RoBERTa: 2)",
                                   note="0 = BERT")
    pad_token_id: int | None = setting(None, "with position_offset: left padding shifts each row's positions "
                                       "(RoBERTa)", none="no shift")
    placement: str = TransformerConfig.override("placement", "post")
    norm_eps: float = TransformerConfig.override("norm_eps", 1e-12)

    def validate(self) -> None:
        super().validate()
        if self.head == "classify" and not self.pooler:
            raise ConfigError("head=classify needs pooler=true")


class BERT(QKVModel):
    kinds: ClassVar[tuple[str, ...]] = ("encoder",)
    # the sequence classifier pools the first token: a task puts a [CLS]-like token there
    pools_first_token: ClassVar[bool] = True
    # In training, run the token-wise layers on the real tokens only (nn.attention.Unpadded): a fine-tuning
    # batch with dynamic padding spends ~25% of its matmuls on padding otherwise. The real tokens' outputs,
    # loss and gradients are the same function; the hidden states of padded positions are zeros in training
    # (eval mode computes them as Hugging Face does). Set False on an instance to turn it off.
    unpad_in_training: bool = True

    @classmethod
    def config_for_task(cls, kind: str, needs: dict[str, Any]) -> dict[str, Any]:
        """A task with num_labels wants a sequence classifier: the pooler + classification head."""
        out = dict(needs)
        if "num_labels" in out:
            out.update(head="classify", pooler=True)
        return out

    def __init__(self, config: BERTConfig) -> None:
        super().__init__(config)
        c = config
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.type_emb = nn.Embedding(c.type_vocab_size, c.d_model) if c.type_vocab_size else None
        self.encoder = build_stack(c, c.n_layers, max_len=c.context_length + c.position_offset, causal=False,
                                   embed_norm=True)
        self._add_heads(c.dropout)

    def _add_heads(self, classifier_dropout: float) -> None:
        """The pooler and the config's head, then every weight initialised; an MLM head's decoder is tied to
        the word embeddings."""
        c = self.config
        self.pooler = nn.Linear(c.d_model, c.d_model) if c.pooler else None
        if c.head == "mlm":
            self.mlm_dense = nn.Linear(c.d_model, c.d_model)
            self.mlm_norm = build_norm("layernorm", c.d_model, c.norm_eps)
            self.mlm_decoder = nn.Linear(c.d_model, c.vocab_size)
        elif c.head in ("classify", "tag"):
            self.classifier = nn.Linear(c.d_model, c.num_labels)
            self.cls_drop = nn.Dropout(classifier_dropout)
        self.init_weights(c.n_layers)
        if c.head == "mlm":
            self.mlm_decoder.weight = self.tok_emb.weight

    def _offset(self, input_ids: Tensor) -> int | Tensor:
        """Position of each row's first token. RoBERTa numbers real tokens from position_offset on and
        derives positions from the pad id (HF create_position_ids_from_input_ids): a left-padded row starts
        that many positions lower, so its first real token still sits at position_offset."""
        c = self.config
        if not c.position_offset or c.pad_token_id is None:
            return c.position_offset
        first_real = (input_ids != c.pad_token_id).int().argmax(dim=1)
        return c.position_offset - first_real

    def _embed(self, input_ids: Tensor, token_type_ids: Tensor | None, keep: Tensor | None) -> Tensor:
        """Token (+ segment) embeddings, the stack's input; keep: (B, T) real tokens (a subclass may use
        it)."""
        x = self.tok_emb(input_ids)
        if self.type_emb is not None:
            tt = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            check_token_ids(tt, self.config.type_vocab_size, "token_type_ids")
            x = x + self.type_emb(tt)
        return x

    def _pool(self, h: Tensor) -> Tensor:
        """(B, T, d) -> (B, d): the pooler on the first position."""
        return POOLER_ACTS[self.config.pooler_act](self.pooler(h[:, 0]))

    def forward(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        labels: Tensor | None = None,
        return_attentions: bool = False,
    ) -> ModelOutput:
        """input_ids: (B, T); attention_mask: (B, T) 1 = real token. labels: (B, T) token ids with -100
        where no prediction is wanted (mlm head), (B,) class ids (classify head), or (B, T) label ids with
        -100 on positions without a label (tag head)."""
        c = self.config
        check_batch(input_ids)
        check_token_ids(input_ids, c.vocab_size)
        check_length(input_ids.shape[1], c.context_length)
        if labels is not None and c.head in ("mlm", "tag"):
            check_labels(labels, input_ids)
        if token_type_ids is not None and self.type_emb is None:
            raise ValueError("token_type_ids given, but this model has no segment embeddings "
                             "(type_vocab_size=0)")
        keep = attention_mask.bool() if attention_mask is not None else None
        x = self._embed(input_ids, token_type_ids, keep)
        out = self.encoder(x, keep=keep, offset=self._offset(input_ids), return_weights=return_attentions,
                           unpad=self.training and self.unpad_in_training)
        h = out.hidden
        pooled = self._pool(h) if self.pooler is not None else None
        logits = loss = n = None
        if c.head == "mlm":
            logits = self.mlm_decoder(self.mlm_norm(F.gelu(self.mlm_dense(h))))
            if labels is not None:
                loss, n = token_loss(logits, labels)
        elif c.head == "classify":
            logits = self.classifier(self.cls_drop(pooled))
            if labels is not None:
                loss, n = token_loss(logits, labels)
        elif c.head == "tag":
            logits = self.classifier(self.cls_drop(h))
            if labels is not None:
                loss, n = token_loss(logits, labels)
        return ModelOutput(logits=logits, loss=loss, n_targets=n, last_hidden_state=h, pooled=pooled,
                           attentions=out.attentions or None)


register_family("bert", BERTConfig, BERT)
register_preset("bert-base", "bert", BERTConfig(), "BERT-base, 110M, with pooler (Devlin et al. 2019)")
register_preset("bert-tiny", "bert", BERTConfig(
    vocab_size=256, n_layers=2, d_model=128, n_heads=2, context_length=128, head="mlm"),
    "2 layers, 128 wide, MLM head: CPU-sized")
