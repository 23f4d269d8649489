"""Tiny GGUF files written here the way llama.cpp's convert_hf_to_gguf.py writes them, from random-weight
Hugging Face models: tensor names from gguf's own name map, the q/k rotary permute of `llama` files, norms
kept F32, metadata under llama.cpp's keys, and a tokenizer (byte-level BPE with merges, or a SentencePiece
model with scores) trained on a few lines.

`write_gguf` returns the reference weights: what a reader must recover, in Hugging Face layout (the weights
after a round trip through the file's type), so logits can be compared to float32 precision."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

gguf = __import__("pytest").importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

TEXT = ["Hello world, this is a tiny corpus for a tiny tokenizer.",
        "The quick brown fox jumps over the lazy dog 12345 times!",
        "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation: ; ? ( ) [ ] { } - _ = +",
        "Ünïcödé text, émoji-free, with café and naïve words.",
        "def f(x):\n    return x * 2  # code with indents\n"] * 4
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA2 = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} "
          "[/INST]{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}")


def bpe_vocab(vocab_size: int = 300) -> dict:
    """A byte-level BPE (GPT-2 / Qwen2 / Llama-3 style) as GGUF metadata: tokens, merges, types, ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXT, trainer)
    import json

    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in specials else 1 for t in tokens]
    return {"model": "gpt2", "tokens": tokens, "merges": merges, "types": types,
            "bos": tokens.index("<|endoftext|>"), "eos": tokens.index("<|im_end|>"), "pad": 0,
            "add_bos": False, "template": CHATML}


def spm_vocab(tmp: Path, vocab_size: int = 400) -> dict:
    """A SentencePiece BPE with byte fallback (Llama-2 / Mistral style) as llama.cpp stores it: tokens, scores
    and types, no merges; `model_file` is the .model for transformers' slow reference."""
    import sentencepiece as spm

    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(TEXT), encoding="utf-8")
    prefix = tmp / "spm"
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(prefix), vocab_size=vocab_size,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
                                   split_digits=True, add_dummy_prefix=True,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False)
    sp = spm.SentencePieceProcessor(model_file=str(prefix) + ".model")
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):  # as convert_hf_to_gguf.py's _create_vocab_sentencepiece
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i)
                     else 6 if sp.is_byte(i) else 1)
    return {"model": "llama", "tokens": tokens, "scores": scores, "types": types, "bos": 1, "eos": 2,
            "add_bos": True, "template": LLAMA2, "model_file": str(prefix) + ".model"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rows of each head from HF's rotate-half order to GGML's
    interleaved pairs (rows only: it commutes with the row-wise block quantization)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_factors(head_dim: int, rope: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for rope_type llama3: what each frequency is divided by."""
    import math

    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _k_blocks(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with sane f16 scales (gguf.quants cannot quantize K types)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    # weights of about 0.1 at most: Q6_K's are d * int8 scale * 6-bit value, Q4_K's d * 6-bit scale * 4-bit
    # value
    d = 3e-5 if qtype == Q.Q6_K else 1e-4
    scale = np.full(data.shape[:2], d, dtype=np.float16).view(np.uint8).reshape(*data.shape[:2], 2)
    if qtype == Q.Q6_K:  # ... ql, qh, scales (int8), d
        data[..., -2:] = scale
    else:  # Q4_K / Q5_K: d, dmin, ...
        data[..., 0:2] = scale
        data[..., 2:4] = scale
    return data.reshape(rows, -1)


def encode_tensor(w: torch.Tensor, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, Q, torch.Tensor]:
    """(data to write, its type, the float32 weights a reader should get back). 1-D tensors and rows that
    do not fill whole blocks stay F32, as llama.cpp's converter keeps them."""
    a = w.detach().float().numpy()
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if a.ndim == 1 or qtype == Q.F32 or a.shape[-1] % block:
        return a, Q.F32, torch.from_numpy(a.copy())
    if qtype == Q.F16:
        h = a.astype(np.float16)
        return h, Q.F16, torch.from_numpy(h.astype(np.float32))
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        data = _k_blocks(a.shape[0], a.shape[1], qtype, rng)
    else:  # BF16, Q8_0, Q4_0, ...
        data = gguf.quants.quantize(a, qtype)
    return data, qtype, torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(a.shape).copy())


def write_gguf(path: Path, hf_model, arch: str, vocab: dict, qtype: Q = Q.F32, *, seed: int = 0,
               extra: dict | None = None, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Write `hf_model` as a GGUF file of architecture `arch`; returns {hf name: reference float32 weight}."""
    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(int(qtype))
    for key, value in (extra or {}).items():
        w.add_key_value(key, value[0], value[1])
    w.add_tokenizer_model(vocab["model"])
    w.add_tokenizer_pre({"gpt2": "qwen2" if arch == "qwen2" else "llama-bpe"}.get(vocab["model"], "default"))
    w.add_token_list(vocab["tokens"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    w.add_token_types(vocab["types"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    if "pad" in vocab:
        w.add_pad_token_id(vocab["pad"])
    w.add_add_bos_token(vocab["add_bos"])
    w.add_chat_template(vocab["template"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    rng = np.random.default_rng(seed)
    reference: dict[str, torch.Tensor] = {}
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        data, kind, ref = encode_tensor(t, qtype, rng)
        reference[name] = ref
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute(data, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute(data, cfg.num_key_value_heads)
        if new not in skip:
            w.add_tensor(new, data, raw_dtype=kind)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "linear":  # as TextModel.set_gguf_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    # as LlamaModel.generate_extra_tensors: the factors, not the parameters
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_factors(head_dim, rope), raw_dtype=Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference
