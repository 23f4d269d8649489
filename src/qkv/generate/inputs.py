"""What generate() checks of its inputs before decoding: the layout of a padded batch, the token ids of the
settings, and a prompt that runs past the context a model was configured for."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Any

import torch
from torch import Tensor

from qkv.generate.config import GenerationConfig
from qkv.models.decoding import configured_context


def left_padding(attention_mask: Tensor | None, shape: torch.Size) -> Tensor | None:
    """(B,) number of left-padding tokens, or None when every token is real. Rejects other layouts."""
    if attention_mask is None:
        return None
    if attention_mask.shape != shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(shape)}")
    m = attention_mask.bool()
    if bool(m.all()):
        return None
    n_real = m.sum(1)
    if bool((n_real == 0).any()):
        raise ValueError("a prompt in the batch is all padding (attention_mask row of zeros)")
    # left padding: row b is 0 for its first n_pad positions and 1 after
    expect = torch.arange(m.shape[1], device=m.device).unsqueeze(0) >= (m.shape[1] - n_real).unsqueeze(1)
    if not torch.equal(m, expect):
        raise ValueError("generate needs LEFT-padded prompts (padding first, attention_mask 0...0 1...1); "
                         "right padding would put pad tokens between the prompt and its continuation")
    return (m.shape[1] - n_real).long()


def check_special_ids(cfg: GenerationConfig, vocab: int) -> None:
    """The config's token ids are ids of this model's vocabulary: a pad id is fed to the model for finished
    rows, an eos id outside it would never stop, a forced or banned one would index past the logits (or,
    negative, wrap)."""
    named = {"eos_token_id": cfg.eos_ids, "pad_token_id": [cfg.pad_token_id],
             "forced_bos_token_id": [cfg.forced_bos_token_id], "forced_eos_token_id": cfg.forced_eos_token_id,
             "decoder_start_token_id": [cfg.decoder_start_token_id],
             "bad_words_ids": [i for w in (cfg.bad_words_ids or []) for i in w],
             "logit_bias": list(cfg.logit_bias or {})}
    for name, ids in named.items():
        ids = ids if isinstance(ids, list) else [ids]
        bad = [i for i in ids if i is not None and not 0 <= int(i) < vocab]
        if bad:
            hint = " (eos_token_id=[]: no eos, never stop early)" if name == "eos_token_id" else ""
            raise ValueError(f"{name} {bad[0]} is outside the model's vocabulary [0, {vocab}){hint}")


def warn_past_trained_context(model: Any, T: int, max_new: int, total: int) -> None:
    """RoPE and ALiBi have no hard position limit (context_limit None: extrapolation is a research question
    qkv lets one ask), but a model configured or trained for context_length positions (a Llama folder's
    max_position_embeddings) is not known to work past them: say so once per call instead of silently going
    on."""
    trained = configured_context(model)
    if trained is not None and total > trained:
        warnings.warn(f"prompt of {T} tokens + max_new_tokens={max_new} = {total} positions runs past the "
                      f"model's context_length of {trained} (max_position_embeddings): "
                      f"{model.config.position} positions go on, but the model was not configured for them "
                      "and its output may degrade",
                      stacklevel=outside_level())


def outside_level() -> int:
    """warnings.warn's stacklevel for the first frame outside qkv, torch and contextlib (generate's
    decorators), so that the warning names the caller's line (Python 3.12's skip_file_prefixes, for 3.10+)."""
    inside = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__),
              os.path.dirname(contextlib.__file__) + os.sep + "contextlib")
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level
