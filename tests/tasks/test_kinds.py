"""Tasks branch on model kinds, never on family names: a decoder family registered here, in a test, trains
on the LM tasks and the decoder-only seq2seq tasks through run.train_run unchanged, and generates through
qkv.generate (it implements the decoder protocol by inheriting TransformerDecoderModel)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor, nn

from qkv.config import ConfigError, TransformerConfig
from qkv.models import registry
from qkv.models.base import ModelOutput, TransformerDecoderModel, build_stack, token_loss
from qkv.nn.linear import Linear
from qkv.run import train_run
from qkv.tasks import build_task


@dataclass
class TinyLlamaConfig(TransformerConfig):
    vocab_size: int = 32
    n_layers: int = 2
    context_length: int = 32
    d_model: int = 32
    n_heads: int = 4
    n_kv_heads: int | None = 2
    ffn: str = "swiglu"
    norm: str = "rmsnorm"
    position: str = "rope"
    bias: bool = False


class TinyLlama(TransformerDecoderModel):
    """A decoder family the library has never seen: untied head, RMSNorm, SwiGLU, RoPE, GQA, no biases."""

    kinds: ClassVar[tuple[str, ...]] = ("decoder",)

    def __init__(self, config: TinyLlamaConfig) -> None:
        super().__init__(config)
        c = config
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.decoder = build_stack(c, c.n_layers, max_len=c.context_length, causal=True)
        self.lm_head = Linear(c.d_model, c.vocab_size, bias=False)
        self.init_weights(c.n_layers)

    def forward(self, input_ids: Tensor, *, labels: Tensor | None = None,
                attention_mask: Tensor | None = None,
                cache: Any = None, offset: Any = None, return_attentions: bool = False,
                last_only: bool = False) -> ModelOutput:
        keep = attention_mask.bool() if attention_mask is not None else None
        out = self.decoder(self.tok_emb(input_ids), keep=keep, cache=cache, offset=offset,
                           return_weights=return_attentions)
        h = out.hidden[:, -1:] if last_only else out.hidden
        logits = self.lm_head(h)
        loss = n = None
        if labels is not None:
            loss, n = token_loss(logits[:, :-1], labels[:, 1:])
        return ModelOutput(logits=logits, loss=loss, n_targets=n, attentions=out.attentions or None)

    # the decoder protocol beyond what TransformerDecoderModel gives
    @property
    def output_vocab_size(self) -> int:
        return self.config.vocab_size

    def embed_target(self, ids: Tensor) -> Tensor:
        return self.tok_emb(ids)

    def encode_source(self, inputs: Tensor, attention_mask: Tensor | None = None) -> None:
        return None

    def prefill(self, ids, cache, *, keep=None, offset=None, source=None, return_attentions=False):
        out = self(ids, attention_mask=keep, cache=cache, offset=offset, return_attentions=return_attentions,
                   last_only=True)
        return out.logits[:, -1], out.attentions


@pytest.fixture
def tiny_llama():
    registry.register_family("tiny-llama", TinyLlamaConfig, TinyLlama)
    try:
        yield "tiny-llama"
    finally:
        registry._FAMILIES.pop("tiny-llama", None)


@pytest.mark.parametrize("task", [
    {"name": "charlm", "context": 16, "sample_tokens": 6},
    {"name": "reverse", "min_len": 2, "max_len": 4},
])
def test_a_new_decoder_family_trains_on_decoder_tasks_unchanged(tiny_llama, task, tmp_path):
    cfg = {"model": {"family": tiny_llama, "d_model": 32}, "task": dict(task),
           "train": {"max_steps": 1, "batch_size": 4, "log_every": 1, "save_every": 0},
           "eval": {"n": 2, "samples": 1}}
    res = train_run(cfg, tmp_path / "run", quiet=True)
    assert res["train"]["steps"] == 1 and torch.isfinite(torch.tensor(res["train"]["final_loss"]))
    assert res["samples"]  # decoded through qkv.generate
    built = build_task(task["name"], family=tiny_llama, **{k: v for k, v in task.items() if k != "name"})
    assert built.kind == "decoder"


def test_kind_errors_name_the_kinds(tiny_llama):
    with pytest.raises(ConfigError, match=r"supports model families of kind \['image'\].*not 'tiny-llama' "
                                          r"\(a decoder model\)"):
        build_task("digits", family=tiny_llama)
    with pytest.raises(ValueError, match="kinds must be"):
        registry.register_family("no-kind", TinyLlamaConfig, type("NoKind", (TinyLlama,), {"kinds": ()}))


def test_every_family_declares_its_kinds():
    for name in registry.families():
        kinds = registry.family(name).kinds
        assert kinds and all(k in registry.KINDS for k in kinds), name
    assert registry.family("lstm").kinds == ("decoder", "encoder")  # an LM or a sequence classifier
    assert build_task("listops", family="lstm").kind == "encoder"
    assert build_task("charlm", family="lstm").kind == "decoder"
