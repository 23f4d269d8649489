"""Tiny random Hugging Face encoder-decoders (T5 v1.0, T5 v1.1 gated + untied, BART, Marian), built from our
own configs and saved into a test folder: nothing is downloaded."""

from __future__ import annotations

import json

import torch

transformers = __import__("pytest").importorskip("transformers")

V = 61  # vocabulary (ids 0..60)


def _perturb(model, seed: int) -> None:
    """HF init zeros biases, sets norms to 1 and the final_logits_bias to 0: perturb so every weight
    matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if "relative_attention_bias" in name else 0.05))
        for name, b in model.named_buffers():
            if name.endswith("final_logits_bias"):
                b.add_(torch.randn(b.shape, generator=g) * 0.5)


def t5(folder, *, gated: bool = False, seed: int = 0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=3,
               relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
               feed_forward_proj="gated-gelu" if gated else "relu", decoder_start_token_id=0, pad_token_id=0,
               eos_token_id=1)
    if gated:  # v1.1 / Flan: output not scaled, head untied (a separate lm_head in the file)
        cfg["tie_word_embeddings"] = False
    cfg.update(kw)
    hf = transformers.T5ForConditionalGeneration(transformers.T5Config(**cfg)).eval()
    if gated:
        hf.lm_head.weight = torch.nn.Parameter(torch.randn(V, 32) * 0.5)
    _perturb(hf, seed)
    hf.save_pretrained(folder)
    return transformers.T5ForConditionalGeneration.from_pretrained(folder).eval()


def _add_generation_settings(folder, **settings) -> None:
    """Settings the config classes no longer keep (forced_bos_token_id) go into generation_config.json, as
    in the released BART checkpoints; from_pretrained reads them from there (HF and qkv alike)."""
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))


def _fairseq(folder, model_cls, config_cls, seed: int, generation=None, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=40,
               dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    cfg.update(kw)
    hf = model_cls(config_cls(**cfg)).eval()
    _perturb(hf, seed)
    hf.save_pretrained(folder)
    _add_generation_settings(folder, **(generation or {}))
    return model_cls.from_pretrained(folder).eval()


def bart(folder, seed: int = 0, **kw):
    kw = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "decoder_start_token_id": 2,
          "forced_eos_token_id": 2, **kw}
    return _fairseq(folder, transformers.BartForConditionalGeneration, transformers.BartConfig, seed,
                    generation={"forced_bos_token_id": 0}, **kw)


def marian(folder, seed: int = 0, **kw):
    kw = {"pad_token_id": V - 1, "eos_token_id": 0, "decoder_start_token_id": V - 1, "forced_eos_token_id": 0,
          "activation_function": "swish", "scale_embedding": True, **kw}
    # as the OPUS-MT folders: the pad token (the decoder's start) is never generated; plus a two-token ban
    return _fairseq(folder, transformers.MarianMTModel, transformers.MarianConfig, seed,
                    generation={"bad_words_ids": [[V - 1], [7, 8]]}, **kw)


BUILDERS = {"t5": t5, "t5v11": lambda f, **kw: t5(f, gated=True, **kw), "bart": bart, "marian": marian}
