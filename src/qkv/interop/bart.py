"""Hugging Face BartForConditionalGeneration and MarianMTModel folders -> qkv EncoderDecoder, by one explicit
key map (the two share fairseq's layout), and back (`export_bart`, for fine-tuned models).

Both: Post-LN layers with q/k/v/out projections (biases), self_attn_layer_norm / encoder_attn_layer_norm /
final_layer_norm after each residual, fc1/fc2, one shared embedding, the output projection tied to it, and a
final_logits_bias buffer added to the logits. They differ in:
  BART    learned positions whose table starts two rows early (position p reads row p + 2: position_skip=2),
          a LayerNorm after embeddings + positions in both stacks (layernorm_embedding -> embed_norm), GELU
  Marian  sinusoidal positions laid out as sines then cosines (sinusoidal_layout="halves"; computed, not
          read from the file), embeddings times sqrt(d_model) (scale_embedding), SiLU ("swish") in OPUS-MT

  HF (prefix model.)                         qkv
  shared                                     src_emb (= tgt_emb = lm_head)
  {s}.embed_positions (BART)                 {s}.position (Learned, skip 2)
  {s}.layernorm_embedding (BART)             {s}.embed_norm
  {s}.layers.i.self_attn.q|k|v|out_proj      {s}.blocks.i.attn.qkv_proj (q,k,v stacked) | out_proj
  {s}.layers.i.self_attn_layer_norm          {s}.blocks.i.norm1
  decoder.layers.i.encoder_attn.q|k|v|out    decoder.blocks.i.cross.q_proj | kv_proj (k,v) | out_proj
  decoder.layers.i.encoder_attn_layer_norm   decoder.blocks.i.norm_cross
  {s}.layers.i.fc1 | fc2                     {s}.blocks.i.ffn.up | down
  {s}.layers.i.final_layer_norm              {s}.blocks.i.norm2
  final_logits_bias                          lm_head.final_logits_bias
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qkv.interop.common import (
    HFTensors,
    build_skeleton,
    check_sizes,
    expand,
    export_state,
    load_hf_weights,
    require,
    write_hf_folder,
)
from qkv.interop.registry import ExportRequest, ModelType, register
from qkv.interop.t5 import generation_from_config
from qkv.models.encdec import EncoderDecoder, EncoderDecoderConfig

ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "swish": "silu", "silu": "silu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh"}
TIED_COPIES = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight")


def config_from_hf(meta: dict[str, Any]) -> EncoderDecoderConfig:
    mt = meta.get("model_type")
    name = "BART" if mt == "bart" else "Marian"
    for a, b in (
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ):
        require(
            meta.get(a) == meta.get(b), f"{name}: {a} != {b}; qkv's encoder-decoder shares heads and ffn size"
        )
    act = meta.get("activation_function", "gelu")
    require(
        act in ACTIVATIONS,
        f"{name} activation_function {act!r} is not supported; supported: {sorted(ACTIVATIONS)}",
    )
    require(
        not meta.get("normalize_before", False),
        f"{name} with normalize_before=true (Pre-LN) is not supported",
    )
    require(
        not meta.get("add_final_layer_norm", False), f"{name} with add_final_layer_norm=true is not supported"
    )
    if mt == "marian":
        require(meta.get("share_encoder_decoder_embeddings", True),
                "Marian with separate source/target embeddings is not supported")
        require(meta.get("decoder_vocab_size") in (None, meta["vocab_size"]),
                "Marian with decoder_vocab_size != vocab_size is not supported")
    require(meta.get("tie_word_embeddings", True) is not False,
            f"{name} with an output projection untied from the embeddings is not supported")
    d = meta["d_model"]
    pad = meta.get("pad_token_id", 1)
    eos = meta.get("eos_token_id", 2)
    start = meta.get("decoder_start_token_id")
    marian = mt == "marian"
    return EncoderDecoderConfig(
        src_vocab_size=meta["vocab_size"],
        n_encoder_layers=meta["encoder_layers"],
        n_decoder_layers=meta["decoder_layers"],
        d_model=d,
        n_heads=meta["encoder_attention_heads"],
        d_ff=meta["encoder_ffn_dim"],
        ffn=ACTIVATIONS[act],
        norm="layernorm",
        norm_eps=1e-5,
        placement="post",
        position="sinusoidal" if marian else "learned",
        position_skip=0 if marian else 2,
        sinusoidal_layout="halves" if marian else "interleaved",
        embed_norm=not marian,
        context_length=meta.get("max_position_embeddings", 1024),
        scale_embeddings=bool(meta.get("scale_embedding")),
        share_embeddings=True,
        logits_bias=True,
        label_smoothing=0.0,
        dropout=float(meta.get("dropout", 0.1)),
        attn_dropout=float(meta.get("attention_dropout", 0.0)),
        init_std=float(meta.get("init_std", 0.02)),
        pad_token_id=pad if pad is not None else 0,
        eos_token_id=eos if eos is not None else 2,
        bos_token_id=start if start is not None else (eos if eos is not None else 2),
    )


def key_map(cfg: EncoderDecoderConfig) -> dict[str, str]:
    p = "model."
    m = {p + "shared.weight": "src_emb.weight", "final_logits_bias": "lm_head.final_logits_bias"}
    for s, n in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        if cfg.position == "learned":
            m[f"{p}{s}.embed_positions.weight"] = f"{s}.position.weight"
        if cfg.embed_norm:
            m.update({f"{p}{s}.layernorm_embedding.{w}": f"{s}.embed_norm.{w}" for w in ("weight", "bias")})
        layer: dict[str, str] = {}
        for w in ("weight", "bias"):
            h, o = f"{p}{s}.layers.{{}}.", f"{s}.blocks.{{}}."
            layer.update({h + f"self_attn.{x}_proj.{w}": o + f"attn.qkv_proj.{w}" for x in "qkv"})
            layer.update({h + f"self_attn.out_proj.{w}": o + f"attn.out_proj.{w}",
                          h + f"self_attn_layer_norm.{w}": o + f"norm1.{w}",
                          h + f"fc1.{w}": o + f"ffn.up.{w}", h + f"fc2.{w}": o + f"ffn.down.{w}",
                          h + f"final_layer_norm.{w}": o + f"norm2.{w}"})
            if s == "decoder":
                layer.update({h + f"encoder_attn.q_proj.{w}": o + f"cross.q_proj.{w}",
                              h + f"encoder_attn.k_proj.{w}": o + f"cross.kv_proj.{w}",
                              h + f"encoder_attn.v_proj.{w}": o + f"cross.kv_proj.{w}",
                              h + f"encoder_attn.out_proj.{w}": o + f"cross.out_proj.{w}",
                              h + f"encoder_attn_layer_norm.{w}": o + f"norm_cross.{w}"})
        m.update(expand(layer, n))
    return m


def load_bart(folder: Path, meta: dict[str, Any]) -> EncoderDecoder:
    # first: a variant it refuses (Marian with its own target vocabulary) says so by name
    cfg = config_from_hf(meta)
    hf_state = HFTensors(folder)  # names, shapes and dtypes now; each tensor read when it is copied
    source = hf_state.source
    if (
        "model.shared.weight" not in hf_state and "shared.weight" in hf_state
    ):  # a base BartModel / MarianModel
        hf_state.rename(lambda k: ("" if k == "final_logits_bias" else "model.") + k)
    require("model.shared.weight" in hf_state, f"{source}: no model.shared.weight")
    shared_meta = hf_state.meta("model.shared.weight")
    positions = ("max_position_embeddings" + (f" + {cfg.position_skip}" if cfg.position_skip else ""),
                 cfg.context_length + cfg.position_skip)  # BART's learned table has 2 rows more
    check_sizes(
        hf_state,
        source,
        [
            ("encoder_layers", cfg.n_encoder_layers, "model.encoder.layers.{}.final_layer_norm.weight", None),
            ("decoder_layers", cfg.n_decoder_layers, "model.decoder.layers.{}.final_layer_norm.weight", None),
            ("vocab_size", cfg.src_vocab_size, "model.shared.weight", 0),
            ("d_model", cfg.d_model, "model.shared.weight", 1),
            (*positions, "model.encoder.embed_positions.weight", 0),
            ("encoder_ffn_dim", cfg.d_ff, "model.encoder.layers.0.fc1.weight", 0),
        ],
    )
    copies = [k for k in TIED_COPIES if k in hf_state]
    if copies:  # copies of the shared embedding carry nothing (read before the model is built, one at a time)
        shared = hf_state["model.shared.weight"]
        for k in copies:
            copy = hf_state[k]
            require(copy.shape == shared.shape and torch.equal(copy, shared),
                    f"{source}: {k} differs from model.shared.weight; qkv loads tied embeddings only")
            del hf_state[k], copy
        del shared
    if "final_logits_bias" not in hf_state:  # a base model has none: zeros are exact (in the file's dtype)
        hf_state["final_logits_bias"] = torch.zeros(1, shared_meta.shape[0], dtype=shared_meta.dtype)
    model = build_skeleton(lambda: EncoderDecoder(cfg))  # parameters on meta; Marian's sinusoids are computed
    # Marian's sinusoidal tables, where a file has them, are recomputed (the same formula, checked by the
    # tests)
    ignore = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight") \
        if cfg.position == "sinusoidal" else ()
    load_hf_weights(model, hf_state, key_map(cfg), ignore=ignore, source=source)
    model.folder_generation_config = generation_from_config(meta)
    return model.eval()


def export_bart(model: EncoderDecoder, out: Path, request: ExportRequest) -> None:
    """Write `model` (loaded by load_bart, then e.g. fine-tuned) as a Hugging Face BART / Marian folder:
    config.json is the source folder's, weights under HF's names."""
    write_hf_folder(out, export_state(model.state_dict(), key_map(model.config)), request.source_config())


SIZING_FIELDS = ("decoder_layers", "decoder_attention_heads", "d_model", "max_position_embeddings")
register(*(ModelType(mt, "seq2seq", "encdec", load_bart, export_bart, sizing_fields=SIZING_FIELDS)
           for mt in ("bart", "marian")))

__all__ = ["config_from_hf", "export_bart", "key_map", "load_bart"]
