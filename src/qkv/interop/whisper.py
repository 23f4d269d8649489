"""Hugging Face WhisperForConditionalGeneration / WhisperModel folders -> qkv Whisper, by an explicit key map.

Whisper's layout: Pre-LN layers with q/k/v/out projections where k_proj has no bias (we load a zero bias into
the k rows of our fused projection: exact), fc1/fc2, encoder and decoder final `layer_norm`, the encoder's
fixed sinusoidal `embed_positions`, learned decoder positions, output projection tied to the token embedding.
Our config has one n_heads / d_ff for both stacks, so encoder and decoder must agree on them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qkv.interop.common import HFTensors, build_skeleton, check_sizes, load_hf_weights
from qkv.interop.registry import ModelType, register
from qkv.interop.vit import hf_activation
from qkv.models.whisper import Whisper, WhisperConfig
from qkv.storage import CheckpointError


def whisper_config_from_hf(meta: dict[str, Any]) -> WhisperConfig:
    if meta["encoder_attention_heads"] != meta["decoder_attention_heads"] or \
            meta["encoder_ffn_dim"] != meta["decoder_ffn_dim"]:
        raise CheckpointError(
            "encoder and decoder of this Whisper differ in heads or ffn size; qkv's Whisper "
            "shares n_heads and d_ff between them"
        )
    if meta.get("scale_embedding", False):
        raise CheckpointError("Whisper folders with scale_embedding=true are not supported")
    return WhisperConfig(
        vocab_size=meta["vocab_size"],
        n_encoder_layers=meta["encoder_layers"],
        n_decoder_layers=meta["decoder_layers"],
        n_audio_ctx=meta["max_source_positions"],
        n_text_ctx=meta["max_target_positions"],
        n_mels=meta["num_mel_bins"],
        d_model=meta["d_model"],
        n_heads=meta["encoder_attention_heads"],
        d_ff=meta["encoder_ffn_dim"],
        ffn=hf_activation(meta.get("activation_function", "gelu")),
        norm_eps=1e-5,
        pad_token_id=meta.get("pad_token_id") or 0,
        bos_token_id=meta.get("decoder_start_token_id")
        if meta.get("decoder_start_token_id") is not None
        else 1,
        eos_token_id=meta.get("eos_token_id") if meta.get("eos_token_id") is not None else 2,
        tie_embeddings=meta.get("tie_word_embeddings", True),
    )


def _attention(h: str, o: str, cross: bool) -> dict[str, str]:
    """q/k/v/out of one HF attention (prefix h) -> our fused projections (prefix o), in concatenation
    order."""
    out: dict[str, str] = {}
    for kind in ("weight", "bias"):
        if cross:
            out.update({f"{h}q_proj.{kind}": f"{o}q_proj.{kind}", f"{h}k_proj.{kind}": f"{o}kv_proj.{kind}",
                        f"{h}v_proj.{kind}": f"{o}kv_proj.{kind}"})
        else:
            out.update({f"{h}{n}_proj.{kind}": f"{o}qkv_proj.{kind}" for n in "qkv"})
        out[f"{h}out_proj.{kind}"] = f"{o}out_proj.{kind}"
    return out


def _ln(h: str, o: str) -> dict[str, str]:
    return {f"{h}.weight": f"{o}.weight", f"{h}.bias": f"{o}.bias"}


def whisper_key_map(prefix: str, n_enc: int, n_dec: int, *, untied: bool) -> dict[str, str]:
    """HF Whisper keys (under `prefix`: "model." or "") -> ours. k_proj.bias is in the map although Whisper's
    files have none: the loader adds zeros for it (exact), so our fused bias is filled whole."""
    e, d = f"{prefix}encoder.", f"{prefix}decoder."
    m = {
        e + "conv1.weight": "conv1.weight", e + "conv1.bias": "conv1.bias",
        e + "conv2.weight": "conv2.weight", e + "conv2.bias": "conv2.bias",
        e + "embed_positions.weight": "encoder.position.weight",
        d + "embed_tokens.weight": "tok_emb.weight",
        d + "embed_positions.weight": "decoder.position.weight",
        **_ln(e + "layer_norm", "encoder.final_norm"), **_ln(d + "layer_norm", "decoder.final_norm"),
    }
    for stack, h0, n in (("encoder", e, n_enc), ("decoder", d, n_dec)):
        for i in range(n):
            h, o = f"{h0}layers.{i}.", f"{stack}.blocks.{i}."
            m.update(_attention(h + "self_attn.", o + "attn.", cross=False))
            m.update(_ln(h + "self_attn_layer_norm", o + "norm1"))
            m.update(_ln(h + "final_layer_norm", o + "norm2"))
            m.update({h + "fc1.weight": o + "ffn.up.weight", h + "fc1.bias": o + "ffn.up.bias",
                      h + "fc2.weight": o + "ffn.down.weight", h + "fc2.bias": o + "ffn.down.bias"})
            if stack == "decoder":
                m.update(_attention(h + "encoder_attn.", o + "cross.", cross=True))
                m.update(_ln(h + "encoder_attn_layer_norm", o + "norm_cross"))
    if untied:
        m["proj_out.weight"] = "lm_head.weight"
    return m


def load_whisper(folder: Path, meta: dict[str, Any]) -> Whisper:
    cfg = whisper_config_from_hf(meta)
    sd = HFTensors(folder)  # names, shapes and dtypes now; each tensor read when it is copied
    if not cfg.tie_embeddings and "proj_out.weight" not in sd:
        raise CheckpointError(f"{folder}: untied Whisper without proj_out.weight")
    prefix = "model." if any(k.startswith("model.") for k in sd) else ""
    e, d = f"{prefix}encoder.", f"{prefix}decoder."
    check_sizes(
        sd,
        sd.source,
        [
            ("encoder_layers", cfg.n_encoder_layers, e + "layers.{}.final_layer_norm.weight", None),
            ("decoder_layers", cfg.n_decoder_layers, d + "layers.{}.final_layer_norm.weight", None),
            ("vocab_size", cfg.vocab_size, d + "embed_tokens.weight", 0),
            ("d_model", cfg.d_model, d + "embed_tokens.weight", 1),
            ("max_source_positions", cfg.n_audio_ctx, e + "embed_positions.weight", 0),
            ("max_target_positions", cfg.n_text_ctx, d + "embed_positions.weight", 0),
            ("num_mel_bins", cfg.n_mels, e + "conv1.weight", 1),
            ("encoder_ffn_dim", cfg.d_ff, e + "layers.0.fc1.weight", 0),
        ],
    )
    mapping = whisper_key_map(
        prefix, cfg.n_encoder_layers, cfg.n_decoder_layers, untied=not cfg.tie_embeddings
    )
    for k in mapping:  # Whisper's k_proj has no bias: a zero one (the q bias's shape and dtype) is exact
        q = k.replace(".k_proj.bias", ".q_proj.bias")
        if k.endswith(".k_proj.bias") and k not in sd and q in sd:
            sd[k] = torch.zeros(sd.meta(q).shape, dtype=sd.meta(q).dtype)
    model = build_skeleton(lambda: Whisper(cfg))  # parameters on meta; the mel filters are computed
    # a tied head is a copy of the token embedding: never read, so not loaded; a bf16 / fp16 folder keeps its
    # dtype
    load_hf_weights(
        model, sd, mapping, ignore=("proj_out.weight",) if cfg.tie_embeddings else (), source=sd.source
    )
    return model.eval()


SIZING_FIELDS = ("decoder_layers", "decoder_attention_heads", "d_model", "max_target_positions",
                 "max_source_positions")
register(ModelType("whisper", "audio", "whisper", load_whisper, sizing_fields=SIZING_FIELDS))
