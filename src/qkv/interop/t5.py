"""Hugging Face T5ForConditionalGeneration folders (T5 v1.0, v1.1 / Flan-T5) -> qkv EncoderDecoder, by an
explicit key map, and back (`export_t5`, for fine-tuned models that transformers loads again).

T5 in qkv's terms: Pre-LN with T5's RMS norm (no mean, no bias, eps 1e-6), no biases anywhere, no 1/sqrt(d_k)
in the attention (folded into T5's initialisation), a bucketed relative position bias learned in the first
layer of each stack and added by every layer (position="relative", the bias hook), ReLU (v1.0) or gated
tanh-GELU (v1.1 "gated-gelu") feed-forward, head width d_kv (n_heads * d_kv may differ from d_model), one
shared embedding, and an output projection that is either tied to it with the hidden states scaled by
d_model**-0.5 (v1.0) or separate and unscaled (v1.1).

  HF                                                   qkv
  shared                                               src_emb (= tgt_emb)
  {enc,dec}.block.0.layer.0.SelfAttention.relative_attention_bias   {encoder,decoder}.position (RelativeBias)
  {s}.block.i.layer.0.SelfAttention.q|k|v|o            {s}.blocks.i.attn.qkv_proj (q,k,v stacked) | out_proj
  {s}.block.i.layer.0.layer_norm                       {s}.blocks.i.norm1
  decoder.block.i.layer.1.EncDecAttention.q|k|v|o      decoder.blocks.i.cross.q_proj | kv_proj | out_proj
  decoder.block.i.layer.1.layer_norm                   decoder.blocks.i.norm_cross
  {s}.block.i.layer.{1|2}.DenseReluDense.wi|wi_0|wi_1|wo   ffn.up | ffn.gate | ffn.up | ffn.down
  {s}.block.i.layer.{1|2}.layer_norm                   {s}.blocks.i.norm2
  {s}.final_layer_norm                                 {s}.final_norm
  lm_head (untied only)                                lm_head
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
from qkv.models.encdec import EncoderDecoder, EncoderDecoderConfig

FFN = {"relu": "relu", "gated-gelu": "geglu_tanh", "gated-gelu_new": "geglu_tanh", "gelu": "gelu",
       "gelu_new": "gelu_tanh"}
# generation settings older folders keep in config.json (transformers reads them from there when the folder
# has no generation_config.json)
GENERATION_KEYS = (
    "num_beams",
    "max_length",
    "min_length",
    "length_penalty",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "early_stopping",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "decoder_start_token_id",
    "eos_token_id",
    "pad_token_id",
    "bos_token_id",
)


def generation_from_config(meta: dict[str, Any]) -> dict[str, Any]:
    """The generation settings of a config.json (those qkv implements), as GenerationConfig fields."""
    return {k: meta[k] for k in GENERATION_KEYS if meta.get(k) is not None}


def scales_output(meta: dict[str, Any]) -> bool:
    """T5 v1.0 scales the decoder output by d_model**-0.5 before the (tied) head, v1.1 does not. Newer
    transformers write `scale_decoder_outputs`; older folders say it with tie_word_embeddings=false."""
    if "scale_decoder_outputs" in meta:
        return bool(meta["scale_decoder_outputs"])
    return meta.get("tie_word_embeddings", True) is not False


def config_from_hf(meta: dict[str, Any], *, tied: bool) -> EncoderDecoderConfig:
    ffn = meta.get("feed_forward_proj", "relu")
    require(ffn in FFN, f"T5 feed_forward_proj {ffn!r} is not supported; supported: {sorted(FFN)}")
    d_model = meta.get("d_model", 512)
    n_layers = meta.get("num_layers", 6)
    n_dec = meta.get("num_decoder_layers") or n_layers
    eos = meta.get("eos_token_id", 1)
    pad = meta.get("pad_token_id", 0)
    start = meta.get("decoder_start_token_id")
    return EncoderDecoderConfig(
        src_vocab_size=meta.get("vocab_size", 32128),
        n_encoder_layers=n_layers,
        n_decoder_layers=n_dec,
        d_model=d_model,
        n_heads=meta.get("num_heads", 8),
        head_dim=meta.get("d_kv", 64),
        d_ff=meta.get("d_ff", 2048),
        ffn=FFN[ffn],
        norm="rmsnorm",
        norm_eps=float(meta.get("layer_norm_epsilon", 1e-6)),
        placement="pre",
        position="relative",
        relative_buckets=meta.get("relative_attention_num_buckets", 32),
        relative_max_distance=meta.get("relative_attention_max_distance", 128),
        scaled=False,
        bias=False,
        dropout=float(meta.get("dropout_rate", 0.1)),
        label_smoothing=0.0,
        share_embeddings=True,
        scale_embeddings=False,
        tie_output=tied,
        output_scale=d_model**-0.5 if scales_output(meta) else 1.0,
        context_length=meta.get("n_positions", 512),
        pad_token_id=pad if pad is not None else 0,
        eos_token_id=(eos[0] if isinstance(eos, list) else eos) or 1,
        bos_token_id=start if start is not None else (pad if pad is not None else 0),
        init_std=float(meta.get("initializer_factor", 1.0)) * 0.05,
    )


def key_map(cfg: EncoderDecoderConfig) -> dict[str, str]:
    """HF key -> our key for this config (concrete: layers expanded)."""
    gated = cfg.ffn == "geglu_tanh"

    def ffn(hf: str, ours: str) -> dict[str, str]:
        if gated:
            return {hf + "wi_0.weight": ours + "gate.weight", hf + "wi_1.weight": ours + "up.weight",
                    hf + "wo.weight": ours + "down.weight"}
        return {hf + "wi.weight": ours + "up.weight", hf + "wo.weight": ours + "down.weight"}

    m = {"shared.weight": "src_emb.weight",
         "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": "encoder.position.weight",
         "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": "decoder.position.weight",
         "encoder.final_layer_norm.weight": "encoder.final_norm.weight",
         "decoder.final_layer_norm.weight": "decoder.final_norm.weight"}
    for stack, n in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        hf, ours = f"{stack}.block.{{}}.layer.", f"{stack}.blocks.{{}}."
        layer = {f"{hf}0.SelfAttention.{x}.weight": f"{ours}attn.qkv_proj.weight" for x in "qkv"}
        layer.update({f"{hf}0.SelfAttention.o.weight": f"{ours}attn.out_proj.weight",
                      f"{hf}0.layer_norm.weight": f"{ours}norm1.weight"})
        f = 1
        if stack == "decoder":
            cross = hf + "1.EncDecAttention."
            layer.update({cross + "q.weight": ours + "cross.q_proj.weight",
                          cross + "k.weight": ours + "cross.kv_proj.weight",
                          cross + "v.weight": ours + "cross.kv_proj.weight",
                          cross + "o.weight": ours + "cross.out_proj.weight",
                          hf + "1.layer_norm.weight": ours + "norm_cross.weight"})
            f = 2
        layer.update(ffn(f"{stack}.block.{{}}.layer.{f}.DenseReluDense.", f"{stack}.blocks.{{}}.ffn."))
        layer[f"{stack}.block.{{}}.layer.{f}.layer_norm.weight"] = f"{stack}.blocks.{{}}.norm2.weight"
        m.update(expand(layer, n))
    if not (cfg.tie_output if cfg.tie_output is not None else cfg.share_embeddings):
        m["lm_head.weight"] = "lm_head.weight"
    return m


TIED_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight")


def load_t5(folder: Path, meta: dict[str, Any]) -> EncoderDecoder:
    hf_state = HFTensors(folder)  # names, shapes and dtypes now; each tensor read when it is copied
    source = hf_state.source
    require(
        "shared.weight" in hf_state, f"{source}: no shared.weight (not a T5ForConditionalGeneration folder?)"
    )
    # copies of the shared embedding (older files store them) carry nothing; a different lm_head is untied.
    # Deciding that reads them before the model is built (each beside the shared embedding, then dropped).
    copies = [
        k
        for k in TIED_COPIES
        if k in hf_state and hf_state.meta(k).shape == hf_state.meta("shared.weight").shape
    ]
    if copies:
        shared = hf_state["shared.weight"]
        for k in copies:
            if torch.equal(hf_state[k], shared):
                del hf_state[k]
        del shared
    for k in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        require(k not in hf_state, f"{source}: {k} differs from shared.weight; qkv's T5 shares one embedding")
    cfg = config_from_hf(meta, tied="lm_head.weight" not in hf_state)
    ffn = "wi_0" if cfg.ffn == "geglu_tanh" else "wi"
    attn = "encoder.block.0.layer.0.SelfAttention."
    check_sizes(hf_state, source, [
        ("num_layers", cfg.n_encoder_layers, "encoder.block.{}.layer.0.layer_norm.weight", None),
        ("num_decoder_layers", cfg.n_decoder_layers, "decoder.block.{}.layer.0.layer_norm.weight", None),
        ("vocab_size", cfg.src_vocab_size, "shared.weight", 0), ("d_model", cfg.d_model, "shared.weight", 1),
        ("num_heads * d_kv", cfg.n_heads * cfg.head_dim, attn + "q.weight", 0),
        ("relative_attention_num_buckets", cfg.relative_buckets, attn + "relative_attention_bias.weight", 0),
        ("d_ff", cfg.d_ff, f"encoder.block.0.layer.1.DenseReluDense.{ffn}.weight", 0)])
    model = build_skeleton(lambda: EncoderDecoder(cfg))  # parameters on meta: storage in the file's dtype
    load_hf_weights(model, hf_state, key_map(cfg), source=source)
    model.folder_generation_config = generation_from_config(meta)
    return model.eval()


def export_t5(model: EncoderDecoder, out: Path, request: ExportRequest) -> None:
    """Write `model` (loaded by load_t5, then e.g. fine-tuned) as a Hugging Face T5 folder: config.json is the
    source folder's, weights under HF's names; transformers' T5ForConditionalGeneration loads it."""
    write_hf_folder(out, export_state(model.state_dict(), key_map(model.config)), request.source_config())


register(ModelType("t5", "seq2seq", "encdec", load_t5, export_t5,
                   sizing_fields=("num_layers", "num_heads", "d_kv")))

__all__ = ["config_from_hf", "export_t5", "key_map", "load_t5"]
