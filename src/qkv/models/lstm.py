"""LSTM baseline (Hochreiter & Schmidhuber 1997) for the LSTM-vs-Transformer comparison, on the same tasks
and trainer as the transformers: same batch keys, same ModelOutput.

mode 'lm':       ids (B, T) -> embedding -> n_layers LSTM (unidirectional) -> LM head (tied to the
                 embedding, Press & Wolf 2017) -> logits (B, T, vocab); labels aligned with input_ids and
                 shifted inside, like GPT.
mode 'classify': ids (B, T) -> embedding -> n_layers LSTM (bidirectional by default), padding skipped
                 with pack_padded_sequence -> final hidden state of the last layer (both directions
                 concatenated) -> linear -> logits (B, num_labels); labels (B,).

Decoding: the LSTM implements the decoder protocol (models/decoding.py), so `model.generate(...)` is the
shared qkv.generate (greedy, sampling, beam search, streaming, stop strings): `make_cache()` returns an
LSTMCache (the recurrent state (h, c) plus a length) and `forward(..., cache=...)` consumes only the new
tokens, like a KV cache; left-padded prompts step through the padding with the state held (`prefill`).

`hidden_for_params(n, ...)` picks the width whose parameter count is closest to `n` (e.g. a transformer's
`num_parameters()`), for equal-size comparisons; `lstm_num_parameters(config)` is the closed form.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence

from qkv.config import ConfigError, check_fields, setting
from qkv.models.base import ModelOutput, QKVModel, token_loss
from qkv.models.decoding import Source
from qkv.models.registry import register_family, register_preset
from qkv.nn.checks import check_batch, check_token_ids


@dataclass
class LSTMConfig:
    vocab_size: int = setting(256, "token vocabulary", ge=1)
    d_model: int = setting(256, "embedding size = hidden size of every LSTM layer", ge=1)
    n_layers: int = setting(2, "stacked LSTM layers", ge=1)
    dropout: float = setting(0.0, "on embeddings, between layers and before the head", ge=0, lt=1)
    bidirectional: bool = setting(False, "only for mode=classify (an LM must not see the future)")
    mode: Literal["lm", "classify"] = setting("lm", "lm (next-token prediction) or classify (sequence "
                                              "classification)")
    num_labels: int = setting(2, "classes, mode=classify (there at least 1)")
    context_length: int = setting(256, "longest input accepted (interface symmetry; the LSTM itself has no "
                                  "limit)", ge=1)
    tie_embeddings: bool = setting(True, "LM head shares the embedding matrix (mode=lm)")
    pad_token_id: int = setting(0, "padding token")
    eos_token_id: int | None = setting(None, "default stop token for generate()", none="no stop token")

    def validate(self) -> None:
        check_fields(self)
        if self.mode == "lm" and self.bidirectional:
            raise ConfigError("a bidirectional LSTM cannot be a language model: set bidirectional=false or "
                              "mode=classify")
        if self.mode == "classify" and self.num_labels < 1:
            raise ConfigError(f"must be at least 1 for mode=classify, got {self.num_labels}", "num_labels",
                              "LSTMConfig")


class LSTMCache:
    """Recurrent state of a decoding LSTM: (h, c) each (n_layers, B, d), and how many tokens it has seen."""

    def __init__(self, max_len: int | None = None) -> None:
        self.state: tuple[Tensor, Tensor] | None = None
        self.length = 0
        self.max_len = max_len if max_len is not None else 1 << 62  # no limit

    @property
    def offset(self) -> int:
        return self.length

    def reorder(self, rows: Tensor) -> None:
        """Keep/repeat batch rows (beam search)."""
        if self.state is not None:
            self.state = (self.state[0].index_select(1, rows), self.state[1].index_select(1, rows))


class LSTM(QKVModel):
    # mode lm: a decoder (LM and decoder-only seq2seq tasks); mode classify: a sequence classifier
    kinds: ClassVar[tuple[str, ...]] = ("decoder", "encoder")
    is_seq2seq: ClassVar[bool] = False

    @classmethod
    def config_for_task(cls, kind: str, needs: dict[str, Any]) -> dict[str, Any]:
        """The mode follows the kind: decoder -> a unidirectional LM; encoder -> a bidirectional
        classifier."""
        if kind == "decoder":
            return {**needs, "mode": "lm", "bidirectional": False}
        return {**needs, "mode": "classify", "bidirectional": True}

    def __init__(self, config: LSTMConfig) -> None:
        super().__init__(config)
        c = config
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.lstm = nn.LSTM(c.d_model, c.d_model, num_layers=c.n_layers, batch_first=True,
                            dropout=c.dropout if c.n_layers > 1 else 0.0, bidirectional=c.bidirectional)
        dirs = 2 if c.bidirectional else 1
        if c.mode == "lm":
            self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        else:
            self.classifier = nn.Linear(dirs * c.d_model, c.num_labels)
        self.reset_parameters()
        if c.mode == "lm" and c.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def reset_parameters(self) -> None:
        # embeddings U(-0.1, 0.1) as in Zaremba et al. 2014 / AWD-LSTM (N(0,1) is far too large for a tied
        # head); LSTM weights keep PyTorch's U(-1/sqrt(d), 1/sqrt(d)); forget-gate bias 1 (Jozefowicz et al.
        # 2015) so the cell remembers by default. PyTorch gate order: input, forget, cell, output.
        nn.init.uniform_(self.tok_emb.weight, -0.1, 0.1)
        d = self.config.d_model
        for name, p in self.lstm.named_parameters():
            if name.startswith("bias_ih"):
                with torch.no_grad():
                    p.zero_()
                    p[d:2 * d] = 1.0
            elif name.startswith("bias_hh"):
                with torch.no_grad():
                    p.zero_()
        if self.config.mode == "classify":
            nn.init.normal_(self.classifier.weight, std=0.02)
            nn.init.zeros_(self.classifier.bias)

    # -- the decoder protocol (models/decoding.py) --------------------------------------------------------
    @property
    def context_limit(self) -> int | None:
        return None  # a recurrent state has no position limit

    @property
    def output_vocab_size(self) -> int:
        return self.config.vocab_size

    def generation_defaults(self) -> dict[str, Any]:
        c = self.config
        out: dict[str, Any] = {"pad_token_id": c.pad_token_id}
        if c.eos_token_id is not None:
            out["eos_token_id"] = c.eos_token_id
        return {**out, **self.folder_generation_config}

    def make_cache(self, batch_size: int = 1, max_len: int | None = None, **_: Any) -> LSTMCache:
        return LSTMCache(max_len)

    def make_paged_cache(self, num_blocks: int | None = None, block_size: int = 16, **_: Any) -> Any:
        raise ValueError("an LSTM has no key/value cache to page: use generate(), not the serving Engine")

    def encode_source(self, inputs: Tensor, attention_mask: Tensor | None = None) -> Source | None:
        if self.config.mode != "lm":
            raise ValueError("generate needs an LSTM in mode=lm")
        check_token_ids(inputs, self.config.vocab_size, entry=True)
        return None

    def prefill(self, ids: Tensor, cache: LSTMCache | None, *, keep: Tensor | None = None,
                offset: Any = None, source: Source | None = None,
                return_attentions: bool = False) -> tuple[Tensor, list | None]:
        """Next-token logits after `ids`. Left padding (keep 0 on the first columns of a row) is stepped
        through one token at a time with that row's state held, so a padded row ends in exactly the state of
        its unpadded prompt. cache=None recomputes from a fresh state."""
        if return_attentions:
            raise ValueError("an LSTM has no attention weights to return")
        cache = cache if cache is not None else self.make_cache()
        new_keep = None if keep is None else keep.bool()[:, -ids.shape[1]:]
        if new_keep is None or bool(new_keep.all()):
            return self(ids, cache=cache, last_only=True).logits[:, -1], None
        logits = None
        for t in range(ids.shape[1]):
            prev = cache.state
            out = self(ids[:, t:t + 1], cache=cache).logits[:, -1]
            k = new_keep[:, t].view(1, -1, 1)
            if prev is not None:
                cache.state = (torch.where(k, cache.state[0], prev[0]),
                               torch.where(k, cache.state[1], prev[1]))
            else:  # the state before the first token is zero
                cache.state = (cache.state[0] * k, cache.state[1] * k)
            logits = out if logits is None else torch.where(new_keep[:, t:t + 1], out, logits)
        return logits, None

    def step(self, ids: Tensor, cache: LSTMCache, *, keep: Tensor | None = None,
             offset: Any = None) -> Tensor:
        """Next-token logits after the newest (real) tokens ids (B, T)."""
        return self(ids, cache=cache, last_only=True).logits[:, -1]

    def forward(
        self,
        input_ids: Tensor,
        *,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: LSTMCache | None = None,
        offset: Any = None,  # noqa: ARG002  (accepted for decoder-interface symmetry; an LSTM has no positions)
        return_attentions: bool = False,
        last_only: bool = False,
    ) -> ModelOutput:
        """input_ids: (B, T). attention_mask: (B, T) 1 = real token; classify mode packs by it (right or
        left padding both fine); lm mode ignores it for right padding (causal, padding comes last).
        cache: decoding state, fed only the new tokens (lm mode). labels: (B, T) aligned with input_ids
        (lm, shifted inside, -100 ignored) or (B,) class ids (classify)."""
        c = self.config
        if return_attentions:
            raise ValueError("an LSTM has no attention weights to return")
        check_batch(input_ids)
        check_token_ids(input_ids, c.vocab_size)
        x = self.drop(self.tok_emb(input_ids))  # (B, T, d)
        if c.mode == "classify":
            return self._classify(x, labels, attention_mask)
        state = cache.state if cache is not None else None
        h, new_state = self.lstm(x, state)  # (B, T, d)
        if cache is not None:
            cache.state = new_state
            cache.length += input_ids.shape[1]
        h = self.drop(h)
        if last_only:
            h = h[:, -1:]
        logits = self.lm_head(h)  # (B, T, vocab)
        loss = n = None
        if labels is not None:
            loss, n = token_loss(logits[:, :-1], labels[:, 1:])
        return ModelOutput(logits=logits, loss=loss, n_targets=n, last_hidden_state=h)

    def _classify(self, x: Tensor, labels: Tensor | None, attention_mask: Tensor | None) -> ModelOutput:
        B, T, _ = x.shape
        if attention_mask is not None:
            keep = attention_mask.bool()
            lengths = keep.sum(1)
            if bool((lengths == 0).any()):
                raise ValueError("a sequence in the batch is all padding (attention_mask row of zeros)")
            # move each row's real tokens to the front (handles left padding), then pack
            order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
            x = x.gather(1, order.unsqueeze(-1).expand_as(x))
            packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
            _, (h_n, _) = self.lstm(packed)
        else:
            _, (h_n, _) = self.lstm(x)
        dirs = 2 if self.config.bidirectional else 1
        # h_n: (n_layers * dirs, B, d); the last layer's final state per direction (the backward direction's
        # "final" state is the one after reading the first token)
        pooled = h_n[-dirs:].transpose(0, 1).reshape(B, dirs * self.config.d_model)
        logits = self.classifier(self.drop(pooled))  # (B, num_labels)
        loss = n = None
        if labels is not None:
            loss, n = token_loss(logits, labels)
        return ModelOutput(logits=logits, loss=loss, n_targets=n, pooled=pooled)


def lstm_num_parameters(config: LSTMConfig) -> int:
    """Closed-form parameter count. Per LSTM layer and direction: 4 gates x (W_ih (d x in) + W_hh (d x d)
    + two bias vectors of d) (PyTorch keeps b_ih and b_hh); `in` is d for layer 1, dirs*d above."""
    c, d = config, config.d_model
    dirs = 2 if c.bidirectional else 1
    total = c.vocab_size * d
    for layer in range(c.n_layers):
        inp = d if layer == 0 else dirs * d
        total += dirs * 4 * (d * inp + d * d + 2 * d)
    if c.mode == "lm":
        total += 0 if c.tie_embeddings else c.vocab_size * d
    else:
        total += dirs * d * c.num_labels + c.num_labels
    return total


def hidden_for_params(n_params: int, config: LSTMConfig | None = None, **fields: Any) -> int:
    """The d_model (hidden = embedding size) whose LSTM, with `config`'s other fields (or `fields`), has
    the parameter count closest to `n_params` (e.g. GPT.num_parameters(), for an equal-size comparison)."""
    base = replace(config or LSTMConfig(), **fields)
    lo, hi = 1, 1
    while lstm_num_parameters(replace(base, d_model=hi)) < n_params:
        hi *= 2
    while lo < hi:  # smallest d with count >= n_params (the count increases with d)
        mid = (lo + hi) // 2
        if lstm_num_parameters(replace(base, d_model=mid)) < n_params:
            lo = mid + 1
        else:
            hi = mid
    below = max(1, lo - 1)
    return min((below, lo), key=lambda d: abs(lstm_num_parameters(replace(base, d_model=d)) - n_params))


register_family("lstm", LSTMConfig, LSTM)
register_preset("lstm-tiny", "lstm", LSTMConfig(vocab_size=256, d_model=256, n_layers=2, context_length=64),
                "2-layer LSTM language model, 256 wide (the baseline next to gpt-tiny)")
register_preset("bilstm-classify", "lstm",
                LSTMConfig(vocab_size=32, d_model=128, n_layers=1, bidirectional=True,
                mode="classify", num_labels=10, context_length=2048),
                "1-layer bidirectional LSTM classifier, 128 wide (ListOps baseline)")
