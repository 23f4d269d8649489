"""Inputs and config values a user gets wrong: one clear error naming what is wrong (before: an IndexError on
shape[1], cross-entropy's flattened row counts, a ZeroDivisionError deep in a constructor, or silence)."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.config import ConfigError


def _gpt():
    return qkv.build("gpt-nano", vocab_size=13, n_layers=1, d_model=16, n_heads=2, context_length=8).eval()


@pytest.mark.parametrize("name", ["gpt", "bert", "lstm", "encdec"])
def test_unbatched_or_extra_dimension_ids_are_refused_by_name(name):
    build = {"gpt": _gpt, "bert": lambda: qkv.build("bert-tiny"),
             "lstm": lambda: qkv.build("lstm-tiny", vocab_size=13),
             "encdec": lambda: qkv.build("transformer-tiny")}[name]
    m = build().eval()
    for ids in (torch.tensor([1, 2, 3]), torch.zeros(1, 3, 3, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"input_ids must be \(batch, length\)"):
            if name == "encdec":
                m(ids, labels=torch.zeros(1, 2, dtype=torch.long))
            else:
                m(ids)
    if name == "encdec":
        with pytest.raises(ValueError, match=r"decoder_input_ids must be \(batch, length\)"):
            m(torch.zeros(1, 3, dtype=torch.long), decoder_input_ids=torch.tensor([1, 2]))


def test_labels_of_another_shape_are_refused():
    with pytest.raises(ValueError, match=r"labels must have the shape of input_ids \(2, 3\), got \(2, 4\)"):
        _gpt()(torch.zeros(2, 3, dtype=torch.long), labels=torch.zeros(2, 4, dtype=torch.long))
    bert = qkv.build("bert-tiny").eval()
    with pytest.raises(ValueError, match="labels must have the shape"):
        bert(torch.zeros(2, 3, dtype=torch.long), labels=torch.zeros(2, 4, dtype=torch.long))


def test_token_types_for_a_model_without_segment_embeddings_are_refused():
    m = qkv.build("bert-tiny", type_vocab_size=0).eval()
    ids = torch.zeros(1, 3, dtype=torch.long)
    m(ids)  # without token types: fine
    with pytest.raises(ValueError, match="no segment embeddings"):
        m(ids, token_type_ids=torch.ones(1, 3, dtype=torch.long))


@pytest.mark.parametrize("preset, overrides, match", [
    ("vit-digits", dict(patch_size=0), "ViTConfig.patch_size must be at least 1, got 0"),
    ("vit-digits", dict(n_layers=0), "ViTConfig.n_layers must be at least 1, got 0"),
    ("swin-digits", dict(window_size=0), "SwinConfig.window_size must be at least 1, got 0"),
    ("swin-digits", dict(window_size=-2), "SwinConfig.window_size must be at least 1, got -2"),
    ("swin-digits", dict(patch_size=0), "SwinConfig.patch_size must be at least 1, got 0"),
    ("whisper-digits", dict(d_model=2, n_heads=1), "at least 4"),
    ("whisper-digits", dict(n_encoder_layers=0), "WhisperConfig.n_encoder_layers must be at least 1, got 0"),
])
def test_sizes_that_break_a_constructor_are_config_errors(preset, overrides, match):
    with pytest.raises(ConfigError, match=match):
        qkv.build(preset, **overrides)
