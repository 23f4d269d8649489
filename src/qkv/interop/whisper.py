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

from qkv.interop import LOADERS
from qkv.interop.common import load_converted
from qkv.interop.vit import hf_activation, read_hf_weights
from qkv.models.whisper import Whisper, WhisperConfig
from qkv.storage import CheckpointError


def whisper_config_from_hf(meta: dict[str, Any]) -> WhisperConfig:
    if meta["encoder_attention_heads"] != meta["decoder_attention_heads"] or \
            meta["encoder_ffn_dim"] != meta["decoder_ffn_dim"]:
        raise CheckpointError("encoder and decoder of this Whisper differ in heads or ffn size; qkv's Whisper "
                              "shares n_heads and d_ff between them")
    if meta.get("scale_embedding", False):
        raise CheckpointError("Whisper folders with scale_embedding=true are not supported")
    return WhisperConfig(
        vocab_size=meta["vocab_size"], n_encoder_layers=meta["encoder_layers"],
        n_decoder_layers=meta["decoder_layers"], n_audio_ctx=meta["max_source_positions"],
        n_text_ctx=meta["max_target_positions"], n_mels=meta["num_mel_bins"], d_model=meta["d_model"],
        n_heads=meta["encoder_attention_heads"], d_ff=meta["encoder_ffn_dim"],
        ffn=hf_activation(meta.get("activation_function", "gelu")), norm_eps=1e-5,
        pad_token_id=meta.get("pad_token_id") or 0,
        bos_token_id=meta.get("decoder_start_token_id") if meta.get("decoder_start_token_id") is not None else 1,
        eos_token_id=meta.get("eos_token_id") if meta.get("eos_token_id") is not None else 2,
        tie_embeddings=meta.get("tie_word_embeddings", True),
    )


def _attention(sd: dict[str, torch.Tensor], h: str, o: str, cross: bool) -> dict[str, torch.Tensor]:
    """q/k/v/out of one HF attention (prefix h) -> our fused projections (prefix o)."""
    q_w, k_w, v_w = (sd[f"{h}{n}_proj.weight"] for n in "qkv")
    q_b, v_b = sd[f"{h}q_proj.bias"], sd[f"{h}v_proj.bias"]
    k_b = sd.get(f"{h}k_proj.bias", torch.zeros_like(q_b))  # Whisper's k_proj has no bias: zero is exact
    out = {f"{o}out_proj.weight": sd[f"{h}out_proj.weight"], f"{o}out_proj.bias": sd[f"{h}out_proj.bias"]}
    if cross:
        out.update({f"{o}q_proj.weight": q_w, f"{o}q_proj.bias": q_b,
                    f"{o}kv_proj.weight": torch.cat([k_w, v_w]), f"{o}kv_proj.bias": torch.cat([k_b, v_b])})
    else:
        out.update({f"{o}qkv_proj.weight": torch.cat([q_w, k_w, v_w]),
                    f"{o}qkv_proj.bias": torch.cat([q_b, k_b, v_b])})
    return out


def _ln(sd: dict[str, torch.Tensor], h: str, o: str) -> dict[str, torch.Tensor]:
    return {f"{o}.weight": sd[f"{h}.weight"], f"{o}.bias": sd[f"{h}.bias"]}


def whisper_state_from_hf(sd: dict[str, torch.Tensor], n_enc: int, n_dec: int) -> dict[str, torch.Tensor]:
    p = "model." if any(k.startswith("model.") for k in sd) else ""
    e, d = f"{p}encoder.", f"{p}decoder."
    out = {
        "conv1.weight": sd[e + "conv1.weight"], "conv1.bias": sd[e + "conv1.bias"],
        "conv2.weight": sd[e + "conv2.weight"], "conv2.bias": sd[e + "conv2.bias"],
        "encoder.position.weight": sd[e + "embed_positions.weight"],
        "tok_emb.weight": sd[d + "embed_tokens.weight"],
        "decoder.position.weight": sd[d + "embed_positions.weight"],
        **_ln(sd, e + "layer_norm", "encoder.final_norm"), **_ln(sd, d + "layer_norm", "decoder.final_norm"),
    }
    for stack, h0, n in (("encoder", e, n_enc), ("decoder", d, n_dec)):
        for i in range(n):
            h, o = f"{h0}layers.{i}.", f"{stack}.blocks.{i}."
            out.update(_attention(sd, h + "self_attn.", o + "attn.", cross=False))
            out.update(_ln(sd, h + "self_attn_layer_norm", o + "norm1"))
            out.update(_ln(sd, h + "final_layer_norm", o + "norm2"))
            out.update({o + "ffn.up.weight": sd[h + "fc1.weight"], o + "ffn.up.bias": sd[h + "fc1.bias"],
                        o + "ffn.down.weight": sd[h + "fc2.weight"], o + "ffn.down.bias": sd[h + "fc2.bias"]})
            if stack == "decoder":
                out.update(_attention(sd, h + "encoder_attn.", o + "cross.", cross=True))
                out.update(_ln(sd, h + "encoder_attn_layer_norm", o + "norm_cross"))
    if "proj_out.weight" in sd:
        out["lm_head.weight"] = sd["proj_out.weight"]
    return out


def load_whisper(folder: Path, meta: dict[str, Any]) -> Whisper:
    cfg = whisper_config_from_hf(meta)
    sd = read_hf_weights(folder)
    model = Whisper(cfg)
    try:
        state = whisper_state_from_hf(sd, cfg.n_encoder_layers, cfg.n_decoder_layers)
    except KeyError as e:
        raise CheckpointError(f"{folder}: Hugging Face Whisper weight {e} is missing") from None
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise CheckpointError(f"{folder}: untied Whisper without proj_out.weight")
    sd.check_all_read(folder, "Whisper")
    load_converted(model, state, {}, f"{folder} (Hugging Face Whisper)")  # a bf16 / fp16 folder stays in its dtype
    return model.eval()


LOADERS["whisper"] = load_whisper
