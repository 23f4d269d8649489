"""GGUF files (llama.cpp's format) of Llama / Mistral / Qwen2 / Qwen3 models -> qkv GPT.

    model = qkv.from_pretrained("model.gguf")                       # every qkv command takes the file too
    model = qkv.from_pretrained("model-Q4_K_M.gguf", dtype=torch.float32)

Types, block sizes and dequantization come from `gguf`, llama.cpp's own Python package (pip install
qkv[gguf]); the header is parsed in gguf_header.py (gguf's reader is slow on large vocabularies). A GGUF file
is a Hugging Face folder written differently, so loading goes through the Llama folder loader
(interop/llama.py) rather than beside it: the metadata becomes a config.json dict for `config_from_hf`, and
the tensors are offered under their Hugging Face names to `fill_model`. What differs from a folder, and is
undone here:
  names      llama.cpp's (`blk.0.attn_q.weight`), mapped to HF's (`model.layers.0.self_attn.q_proj.weight`);
  shapes     GGUF lists dimensions innermost first (ggml's ne order): reversed;
  types      F32/F16/BF16 as they are, quantized blocks (Q8_0, Q4_0, Q4_K, Q6_K, ...) dequantized by
             `gguf.quants.dequantize`, one tensor at a time, into the model's dtype;
  rotary     convert_hf_to_gguf.py permutes the q/k rows of `llama` files so each head's rotated pairs are
             adjacent (ggml's interleaved RoPE); the inverse permutation restores HF's rotate-half order.
             Qwen2/Qwen3 files use NeoX RoPE (rotate-half) and are stored unpermuted;
  head       no `output.weight` means the head is tied to `token_embd.weight`.
The tokenizer and chat template come from the same file (interop/gguf_tokenizer.py).
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qkv.interop.common import require
from qkv.interop.gguf_header import MAGIC, TensorInfo, read_header
from qkv.interop.llama import config_from_hf, empty_model, fill_model, key_map
from qkv.models.gpt import GPT
from qkv.nn.position import rope_inv_freq
from qkv.storage import CheckpointError

# general.architecture -> (HF model_type, whether q/k rows were permuted for ggml's interleaved RoPE)
ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False)}

# llama.cpp tensor name -> HF name ("{}" = layer)
NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    **{f"blk.{{}}.{g}.{kind}": f"model.layers.{{}}.{h}.{kind}" for g, h in (
        ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
        ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
        ("ffn_down", "mlp.down_proj")) for kind in ("weight", "bias")},
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.attn_q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "blk.{}.attn_k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}
_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def is_gguf(path: str | os.PathLike) -> bool:
    """A file named *.gguf, or any file that starts with GGUF's magic bytes."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def gguf_module() -> Any:
    try:
        import gguf  # noqa: PLC0415  (the optional extra qkv[gguf], imported when a GGUF file is read)
    except ModuleNotFoundError:
        raise CheckpointError("reading GGUF files needs the gguf package: pip install qkv[gguf]") from None
    return gguf


class GGUFFile:
    """A GGUF file's metadata (`meta`, plain Python values) and tensors (`tensors`: where each lies; read on
    demand from the mapped file)."""

    def __init__(self, path: str | os.PathLike) -> None:
        gguf = gguf_module()
        self.path = Path(path)
        self.meta, self.tensors, self._buf = read_header(self.path)
        shards = int(self.meta.get("split.count", 1) or 1)
        if shards > 1:
            raise CheckpointError(f"{self.path}: one of {shards} parts of a split GGUF file; join them first "
                                  "(llama.cpp: llama-gguf-split --merge FIRST-PART OUT.gguf)")
        for t in self.tensors.values():  # a cut file is refused here, before any memory is taken
            if t.ggml_type in gguf.GGML_QUANT_SIZES and t.start + self.nbytes(t) > len(self._buf):
                raise CheckpointError(f"{self.path}: not a readable GGUF file, truncated or corrupt (tensor "
                                      f"{t.name!r} ends at byte {t.start + self.nbytes(t)}, the file at "
                                      f"{len(self._buf)})")

    @staticmethod
    def nbytes(t: TensorInfo) -> int:
        block, size = gguf_module().GGML_QUANT_SIZES[t.ggml_type]
        return math.prod(t.shape) // block * size

    def type_of(self, name: str) -> str:
        """A tensor's GGML type name (F32, Q8_0, ...), refused unless this reader can turn it into floats:
        F32 / F16 / BF16, or a block-quantized type that gguf.quants dequantizes."""
        gguf = gguf_module()
        t = self.tensors[name]
        try:
            kind = gguf.GGMLQuantizationType(t.ggml_type)
        except ValueError:
            raise CheckpointError(f"{self.path}: tensor {name!r} has GGML type {t.ggml_type}, which the "
                                  "installed gguf package does not know") from None
        quantized = gguf.GGML_QUANT_SIZES[kind][0] > 1  # a block of several values per scale
        if kind.name not in _FLOATS and not quantized:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has type {kind.name}, which qkv does not read "
                "(supported: F32, F16, BF16 and the quantized block types)"
            )
        return kind.name

    def tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """One tensor in PyTorch's dimension order, dequantized if need be, as `dtype`."""
        gguf = gguf_module()
        t, kind = self.tensors[name], self.type_of(name)
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=self.nbytes(t), offset=t.start)
        if kind in ("F32", "F16"):
            out = torch.from_numpy(raw.view(np.float32 if kind == "F32" else np.float16).copy())
        elif kind == "BF16":  # numpy has no bfloat16: the 16-bit words, reinterpreted by torch
            out = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
        else:
            blocks = raw.reshape(math.prod(t.shape[:-1]), -1)
            try:
                out = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]))
            except NotImplementedError:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} has type {kind}, which the installed gguf "
                    "package cannot dequantize"
                ) from None
        out = out.reshape(t.shape).to(dtype)
        self._release(t.start, self.nbytes(t))
        return out

    def _release(self, start: int, n: int) -> None:
        """Drop the file's pages a read tensor was copied out of from this process's memory (read-only file
        pages, read again from the page cache if ever needed), so loading holds the model, not the model and
        the file."""
        page = mmap.PAGESIZE
        first = start - start % page
        if hasattr(mmap, "MADV_DONTNEED"):  # not on Windows
            self._buf.madvise(mmap.MADV_DONTNEED, first, start + n - first)


def hf_config(f: GGUFFile) -> dict[str, Any]:
    """The config.json a Hugging Face folder of this model would have, from the file's metadata."""
    meta = f.meta
    arch = meta.get("general.architecture")
    require(arch in ARCHITECTURES, f"{f.path}: GGUF architecture {arch!r} is not supported; supported: "
                                   f"{sorted(ARCHITECTURES)}")
    model_type, _ = ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{f.path}: the metadata has no {arch}.{key}")
        return value

    heads = int(get("attention.head_count"))
    d = int(get("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or d // heads)
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    require(rope_dims is None or int(rope_dims) == head_dim,
            f"{f.path}: RoPE on {rope_dims} of {head_dim} dimensions per head is not supported")
    # the embedding's rows are the model's vocabulary (a token list can be shorter than a padded embedding)
    embedding = f.tensors.get("token_embd.weight")
    vocab = embedding.shape[0] if embedding is not None else meta.get(f"{arch}.vocab_size")
    require(vocab is not None, f"{f.path}: missing tensor 'token_embd.weight'")
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    names = f.tensors
    out: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": d,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(f, arch, head_dim, theta),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_output.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
    }
    if model_type == "llama" and "blk.0.attn_q.bias" in names and not out["attention_bias"]:
        raise CheckpointError(f"{f.path}: q/k/v biases without an output bias are Qwen2's, not llama's")
    return out


# Llama 3.1's published rule (Llama 3.2 and 3.3 change only the factor): llama.cpp stores its result as the
# rope_freqs tensor and drops the parameters, so a file's factors are matched against it
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope_scaling(f: GGUFFile, arch: str, head_dim: int, theta: float) -> dict[str, Any] | None:
    kind = f.meta.get(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in f.tensors:  # per-frequency divisors of the rotation frequencies
        return _llama3_scaling(f, head_dim, theta)
    if kind == "none":
        return None
    require(kind == "linear", f"{f.path}: RoPE scaling {kind!r} is not supported (supported: none, linear)")
    return {"rope_type": "linear", "factor": float(f.meta[f"{arch}.rope.scaling.factor"])}


def _llama3_scaling(f: GGUFFile, head_dim: int, theta: float) -> dict[str, Any]:
    """The llama3 rope_scaling whose per-frequency factors are the file's rope_freqs, or a clear refusal."""
    factors = f.tensor("rope_freqs.weight", torch.float64)
    require(
        factors.shape == (head_dim // 2,),
        f"{f.path}: rope_freqs.weight has shape {tuple(factors.shape)}, expected ({head_dim // 2},)",
    )
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), **LLAMA3_ROPE}
    plain = rope_inv_freq(head_dim, theta)
    implied = plain / rope_inv_freq(head_dim, theta, scaling)
    require(
        torch.allclose(implied, factors, rtol=1e-5, atol=0),
        f"{f.path}: its rope_freqs.weight factors are not Llama 3's rule for any factor (low/high frequency "
        "factors 1/4 of 8192 positions); such per-frequency RoPE factors are not supported",
    )
    return scaling


def hf_name(name: str) -> str | None:
    """llama.cpp's name of a tensor -> HF's (None for a name this loader does not know)."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        pattern = NAMES.get(".".join(["blk", "{}", *parts[2:]]))
        return None if pattern is None else pattern.format(parts[1])
    return NAMES.get(name)


class GGUFTensors(Mapping[str, torch.Tensor]):
    """A GGUF file's tensors under HF's names, in HF's layout (unpermuted q/k rows), each read when asked for,
    as fill_model reads a folder's."""

    def __init__(self, f: GGUFFile, config: Mapping[str, Any], dtype: torch.dtype) -> None:
        self.file, self.dtype, self.source = f, dtype, str(f.path)
        self.names: dict[str, str] = {}  # HF name -> GGUF name
        for name in f.tensors:
            if name == "rope_freqs.weight":  # read into the config's rope_scaling (hf_config)
                continue
            f.type_of(name)  # an unreadable type is refused before any memory is taken
            hf = hf_name(name)
            if hf is None:
                raise CheckpointError(f"{f.path}: unexpected tensor {name!r}; this {config['model_type']} "
                                      "variant is not supported by the loader")
            self.names[hf] = name
        permuted = ARCHITECTURES[f.meta["general.architecture"]][1]
        heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
        self.heads = {"q_proj": heads, "k_proj": kv} if permuted else {}

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.file.tensor(self.names[name], self.dtype)
        proj = name.split(".")[-2]
        if proj in self.heads:
            t = unpermute(t, self.heads[proj])
        return t


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from ggml's interleaved
    pairs (x0, x_{d/2}, x1, ...) back to HF's halves (x0..x_{d/2-1}, x_{d/2}..)."""
    rows = w.shape[0]
    require(rows % (2 * n_head) == 0, f"{rows} rows do not split into {n_head} heads of rotary pairs")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _default_dtype(f: GGUFFile) -> torch.dtype:
    """The type of the embedding when it is a float type (as a folder keeps its dtype), else bfloat16: a
    quantized file's weights are dequantized, and in float32 they would take twice the memory."""
    kind = f.type_of("token_embd.weight") if "token_embd.weight" in f.tensors else "F32"
    return _FLOATS.get(kind, torch.bfloat16)


def load_gguf(path: str | os.PathLike, dtype: torch.dtype | None = None) -> GPT:
    """A GGUF file -> our GPT in eval mode, in `dtype` (default: the file's float type, bfloat16 for a
    quantized file). Its token ids become the model's generation defaults."""
    f = GGUFFile(path)
    hf = hf_config(f)
    try:
        config = config_from_hf(hf)
    except CheckpointError as e:
        raise CheckpointError(f"{f.path}: {e}") from None
    dtype = dtype or _default_dtype(f)
    tensors = GGUFTensors(f, hf, dtype)
    mapping = key_map(config)
    missing = [k for k in mapping if k not in tensors]
    if missing:
        gguf_names = {v: k for k, v in NAMES.items()}
        first = missing[0]
        layer = next((p for p in first.split(".") if p.isdigit()), None)
        pattern = first.replace(f".{layer}.", ".{}.") if layer is not None else first
        name = gguf_names.get(pattern, first).format(layer)
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{f.path}: missing tensor {name!r}{more}")
    model = empty_model(config, dtype)
    fill_model(model, tensors, mapping)
    ids = {f"{k}_token_id": f.meta.get(f"tokenizer.ggml.{g}_token_id")
           for k, g in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))}
    model.folder_generation_config = {k: int(v) for k, v in ids.items() if v is not None}
    return model.eval()


__all__ = ["GGUFFile", "hf_config", "is_gguf", "load_gguf", "unpermute"]
