"""Sentence embeddings from a BERT-family folder (BERT, RoBERTa, XLM-R, DistilBERT, DeBERTa-v2/v3;
sentence-transformers folders too), image and text embeddings from a CLIP folder (qkv.image_text), and nearest
neighbours by cosine similarity.

    qkv embed DIR --input texts.txt --out emb.npy [--pooling mean|cls] [--batch-size 32]
    qkv embed DIR --input texts.txt --query "a question" [--top-k 5]
    qkv embed CLIP_DIR --image a.png b.png --out img.npy [--query "a dog"]    (or --text T... / --input FILE)

One text per line of texts.txt -> one row of emb.npy (float32, L2-normalised unless --no-normalize). Pooling:
the mean of the last hidden states over the real tokens (special tokens included, padding excluded: what
sentence-transformers' mean pooling computes), or the first token's state (cls). A sentence-transformers
folder's 1_Pooling/config.json picks the default, its sentence_bert_config.json's max_seq_length the length
texts are cut at (as sentence-transformers cuts them: often below the model's context, e.g. 256 of 512), and a
module in its modules.json that qkv does not apply (a Dense projection) is refused rather than left out. Texts
are sorted by length into batches (less padding) and put back in input order; texts over the limit are
truncated and counted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from qkv.config import ConfigError
from qkv.finetune.encoders import encode, open_encoder, pad_batch
from qkv.image_text import image_embeddings, is_clip_folder, open_clip, text_embeddings
from qkv.storage import atomic_write
from qkv.tasks.base import text_lines

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


# sentence-transformers modules (modules.json "type") that `qkv embed` computes: the encoder, mean/cls
# pooling, and L2 normalisation (on by default, --no-normalize turns it off)
APPLIED_MODULES = ("Transformer", "Pooling", "Normalize")


def folder_max_length(folder: str | Path) -> int | None:
    """A sentence-transformers folder's max_seq_length (sentence_bert_config.json), the length it cuts texts
    at; a module its modules.json lists that qkv does not apply is a ConfigError (its embeddings would
    differ)."""
    folder = Path(folder)
    modules = folder / "modules.json"
    if modules.is_file():
        try:
            listed = json.loads(modules.read_text(encoding="utf-8"))
            types = [str(m.get("type", "")) for m in listed]
        except (ValueError, AttributeError, TypeError) as e:
            raise ConfigError(f"{modules}: not a sentence-transformers module list ({e})") from None
        other = [t for t in types if t.rsplit(".", 1)[-1] not in APPLIED_MODULES]
        if other:
            raise ConfigError(f"{modules} lists {', '.join(other)}, which qkv embed does not apply (it "
                              f"computes {', '.join(APPLIED_MODULES)}): its embeddings would not be the "
                              "folder's")
    cfg = folder / "sentence_bert_config.json"
    if not cfg.is_file():
        return None
    try:
        value = json.loads(cfg.read_text(encoding="utf-8")).get("max_seq_length")
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"{cfg}: not a JSON object ({e})") from None
    if value is None:
        return None
    if not isinstance(value, int) or value < 2:
        raise ConfigError(f"{cfg}: max_seq_length must be an integer >= 2, got {value!r}")
    return value


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
    lines = text_lines(path.read_text(encoding="utf-8"))  # not str.splitlines: see text_lines
    for i, line in enumerate(lines, 1):
        if not line.strip():
            raise ConfigError(f"{path} line {i} is empty: one text per line, each row of the output is one "
                              "line")
    if not lines:
        raise ConfigError(f"{path}: no texts")
    return lines


def embed_texts(encoder: Any, texts: list[str], *, pooling: str = "mean", normalize: bool = True,
                batch_size: int = 32, device: str = "cpu", progress: bool = False,
                max_length: int | None = None) -> tuple[np.ndarray, int]:
    """(embeddings (N, d) float32 in input order, how many texts were truncated). `encoder` is a
    qkv.finetune.encoders.EncoderFolder (open_encoder(folder)); texts are cut at max_length tokens (a
    sentence-transformers folder's max_seq_length: folder_max_length) or the model's context, the smaller."""

    if pooling not in POOLINGS:
        raise ConfigError(f"pooling must be one of {list(POOLINGS)}, got {pooling!r}")
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    model = encoder.model.to(device).eval()
    limit = encoder.max_length if max_length is None else min(max_length, encoder.max_length)
    encs, cut = encode(encoder.tokenizer, texts, None, limit, "truncate", "input")
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


def run(folder: str, input_path: str | None = None, *, texts: list[str] | None = None,
        images: list[str] | None = None, out: str | None = None, query: str | None = None, top_k: int = 5,
        pooling: str | None = None, normalize: bool = True, batch_size: int = 32, device: str = "auto",
        progress: bool = True) -> list[str]:
    """What `qkv embed` does; returns the lines it prints. The rows: the lines of `input_path`, or `texts`,
    or (a CLIP folder) the image files `images`."""
    if out is None and query is None:
        raise ConfigError("give --out FILE.npy to save the embeddings, --query TEXT to search them, or both")
    if top_k < 1:
        raise ConfigError(f"--top-k must be >= 1, got {top_k}")
    if sum(x is not None for x in (input_path, texts, images)) != 1:
        raise ConfigError("give the rows to embed one way: --input FILE, --text TEXT..., or --image FILE...")
    if is_clip_folder(folder):
        return run_clip(folder, input_path, texts=texts, images=images, out=out, query=query, top_k=top_k,
                        batch_size=batch_size, device=device)
    if images is not None:
        raise ConfigError(f"--image needs a CLIP folder; {folder} holds a text encoder")
    return run_text(folder, texts if texts is not None else read_texts(input_path), out=out, query=query,
                    top_k=top_k, pooling=pooling, normalize=normalize, batch_size=batch_size, device=device,
                    progress=progress)


def run_text(folder: str, texts: list[str], *, out: str | None, query: str | None, top_k: int,
             pooling: str | None, normalize: bool, batch_size: int, device: str, progress: bool) -> list[str]:
    """qkv embed over a BERT-family folder."""
    check_texts(texts)
    encoder = open_encoder(folder)
    pooling = pooling or folder_pooling(folder) or "mean"
    max_length = folder_max_length(folder)
    limit = encoder.max_length if max_length is None else min(max_length, encoder.max_length)
    dev = pick_device(device)
    emb, cut = embed_texts(encoder, texts, pooling=pooling, normalize=normalize, batch_size=batch_size,
                           device=dev, progress=progress, max_length=limit)
    lines = []
    if cut:
        what = "the model's context" if limit == encoder.max_length else "the folder's max_seq_length"
        lines.append(f"note: {cut} text(s) longer than {what} of {limit} tokens were truncated")
    if out is not None:
        lines.append(save_embeddings(out, emb, f"{pooling} pooling{', L2-normalised' if normalize else ''}"))
    if query is not None:
        q, _ = embed_texts(encoder, [query], pooling=pooling, normalize=normalize, device=dev,
                           max_length=limit)
        lines += ranked(emb, q[0], texts, top_k)
    return lines


def run_clip(folder: str, input_path: str | None, *, texts: list[str] | None, images: list[str] | None,
             out: str | None, query: str | None, top_k: int, batch_size: int, device: str) -> list[str]:
    """qkv embed over a CLIP folder: image files or texts into the shared embedding space."""
    clip = open_clip(folder, pick_device(device))
    if images is not None:
        rows, emb = images, image_embeddings(clip, images, batch_size)
    else:
        rows = texts if texts is not None else read_texts(input_path)
        check_texts(rows)
        emb = text_embeddings(clip, rows, batch_size)
    lines = []
    if out is not None:
        lines.append(save_embeddings(out, emb, f"CLIP {'image' if images is not None else 'text'} "
                                               "embeddings, L2-normalised"))
    if query is not None:
        lines += ranked(emb, text_embeddings(clip, [query])[0], rows, top_k)
    return lines


def check_texts(texts: list[str]) -> None:
    if not texts:
        raise ConfigError("no texts to embed")
    for i, text in enumerate(texts, 1):
        if not text.strip():
            raise ConfigError(f"text {i} is empty: each row of the output is one text")


def pick_device(device: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def save_embeddings(out: str, emb: np.ndarray, what: str) -> str:
    """Write `emb` to `out` (.npy, atomically); the line that says so."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.save(f, emb)

    atomic_write(path, write)
    return f"wrote {path}: {emb.shape[0]} x {emb.shape[1]} float32 ({what})"


def ranked(emb: np.ndarray, query: np.ndarray, rows: list[str], top_k: int) -> list[str]:
    """The rows nearest to `query`, one line each: rank, cosine similarity, row number, the row."""
    return [f"{rank:>3}  {sim:.4f}  line {i + 1}: {rows[i][:100]}"
            for rank, (i, sim) in enumerate(nearest(emb, query, top_k), 1)]


__all__ = ["POOLINGS", "embed_texts", "folder_max_length", "folder_pooling", "nearest", "pool",
           "read_texts", "run"]
