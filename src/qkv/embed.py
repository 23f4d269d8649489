"""Sentence embeddings from a BERT-family folder (BERT, RoBERTa, XLM-R, DistilBERT; sentence-transformers
folders too), and nearest neighbours by cosine similarity.

    qkv embed DIR --input texts.txt --out emb.npy [--pooling mean|cls] [--batch-size 32]
    qkv embed DIR --input texts.txt --query "a question" [--top-k 5]

One text per line of texts.txt -> one row of emb.npy (float32, L2-normalised unless --no-normalize). Pooling:
the mean of the last hidden states over the real tokens (special tokens included, padding excluded: what
sentence-transformers' mean pooling computes), or the first token's state (cls). A sentence-transformers
folder's 1_Pooling/config.json picks the default. Texts are sorted by length into batches (less padding) and
put back in input order; texts over the model's context are truncated and counted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qkv.config import ConfigError

POOLINGS = ("mean", "cls")


def folder_pooling(folder: str | Path) -> str | None:
    """The pooling a sentence-transformers folder declares (1_Pooling/config.json), if it declares one."""
    cfg = Path(folder) / "1_Pooling" / "config.json"
    if not cfg.is_file():
        return None
    data = json.loads(cfg.read_text(encoding="utf-8"))
    if data.get("pooling_mode_cls_token"):
        return "cls"
    if data.get("pooling_mode_mean_tokens"):
        return "mean"
    raise ConfigError(f"{cfg}: only mean or cls pooling is supported")


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """(B, T, d), (B, T) -> (B, d): the masked mean over tokens, or the first token."""
    if pooling == "cls":
        return hidden[:, 0]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)


def read_texts(path: str | Path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"input file not found: {path}")
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            raise ConfigError(f"{path} line {i} is empty: one text per line, each row of the output is one line")
    if not lines:
        raise ConfigError(f"{path}: no texts")
    return lines


def embed_texts(encoder: Any, texts: list[str], *, pooling: str = "mean", normalize: bool = True,
                batch_size: int = 32, device: str = "cpu", progress: bool = False) -> tuple[np.ndarray, int]:
    """(embeddings (N, d) float32 in input order, how many texts were truncated). `encoder` is a
    qkv.finetune.encoders.EncoderFolder (open_encoder(folder))."""
    from tqdm import tqdm

    from qkv.finetune.encoders import encode, pad_batch

    if pooling not in POOLINGS:
        raise ConfigError(f"pooling must be one of {list(POOLINGS)}, got {pooling!r}")
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    model = encoder.model.to(device).eval()
    encs, cut = encode(encoder.tokenizer, texts, None, encoder.max_length, "truncate", "input")
    order = sorted(range(len(encs)), key=lambda i: len(encs[i].ids))
    out = np.zeros((len(encs), model.config.d_model), dtype=np.float32)
    starts = range(0, len(order), batch_size)
    with torch.no_grad():
        for s in tqdm(starts, desc="embed", unit="batch", disable=not progress, file=sys.stderr):
            idx = order[s:s + batch_size]
            ids = pad_batch([encs[i].ids for i in idx], encoder.pad_id).to(device)
            mask = pad_batch([encs[i].attention_mask for i in idx], 0).to(device)
            h = model(ids, attention_mask=mask).last_hidden_state.float()
            v = pool(h, mask, pooling)
            if normalize:
                v = torch.nn.functional.normalize(v, dim=-1)
            out[idx] = v.cpu().numpy()
    return out, cut


def nearest(emb: np.ndarray, query: np.ndarray, k: int) -> list[tuple[int, float]]:
    """(row, cosine similarity) of the k rows closest to `query`, best first."""
    a = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    q = query / max(float(np.linalg.norm(query)), 1e-12)
    sims = a @ q
    top = np.argsort(-sims, kind="stable")[:k]
    return [(int(i), float(sims[i])) for i in top]


def run(folder: str, input_path: str, *, out: str | None = None, query: str | None = None, top_k: int = 5,
        pooling: str | None = None, normalize: bool = True, batch_size: int = 32, device: str = "auto",
        progress: bool = True) -> list[str]:
    """What `qkv embed` does; returns the lines it prints."""
    from qkv.finetune.encoders import open_encoder

    if out is None and query is None:
        raise ConfigError("give --out FILE.npy to save the embeddings, --query TEXT to search them, or both")
    if top_k < 1:
        raise ConfigError(f"--top-k must be >= 1, got {top_k}")
    texts = read_texts(input_path)
    encoder = open_encoder(folder)
    pooling = pooling or folder_pooling(folder) or "mean"
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    emb, cut = embed_texts(encoder, texts, pooling=pooling, normalize=normalize, batch_size=batch_size,
                           device=dev, progress=progress)
    lines = []
    if cut:
        lines.append(f"note: {cut} text(s) longer than the model's context of {encoder.max_length} tokens were truncated")
    if out is not None:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        from qkv.storage import atomic_write

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                np.save(f, emb)

        atomic_write(path, write)
        lines.append(f"wrote {path}: {emb.shape[0]} x {emb.shape[1]} float32 ({pooling} pooling"
                     f"{', L2-normalised' if normalize else ''})")
    if query is not None:
        q, _ = embed_texts(encoder, [query], pooling=pooling, normalize=normalize, device=dev)
        for rank, (i, sim) in enumerate(nearest(emb, q[0], top_k), 1):
            lines.append(f"{rank:>3}  {sim:.4f}  line {i + 1}: {texts[i][:100]}")
    return lines


__all__ = ["POOLINGS", "embed_texts", "folder_pooling", "nearest", "pool", "read_texts", "run"]
