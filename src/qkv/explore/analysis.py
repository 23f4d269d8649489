"""What the page shows, as plain JSON-able dicts: tokens, attention maps with per-head statistics,
generation step by step with the KV cache, and pictures of the positional encodings.

Every model access goes through `adapter`; this module only shapes tensors into lists. Probabilities are
rounded to 5 decimals (a row of 100 keys still sums to 1 within 5e-4) to keep the JSON small.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from qkv.explore import adapter, media
from qkv.explore.adapter import ExploreError, Loaded

DIGITS = 5
MAX_AUDIO_BINS = 100  # an audio encoder's frames are pooled into at most this many bins for display
MAX_NEW_TOKENS = 64  # generation steps one request may ask for
# attention weights one analysis may return (all views, layers, heads): ~7 bytes each in JSON, so at most
# ~40 MB; GPT-2 small (12 x 12 heads) reaches it at 204 tokens, ViT-B/16's 197 patches stay under it
MAX_WEIGHTS = 6_000_000
TABLE_POSITIONS, TABLE_DIMS = 128, 128  # position tables are drawn up to this size


def rounded(t: Tensor, digits: int = DIGITS) -> Any:
    return torch.round(t.detach().double().cpu(), decimals=digits).tolist()


# -- attention ---------------------------------------------------------------------------------------------
def pool(w: Tensor, q_bins: int, k_bins: int) -> Tensor:
    """(..., Tq, Tk) -> (..., q_bins, k_bins): mean over the queries of a bin, sum over the keys of a bin, so
    every row still sums to 1 (used for audio frames, far too many to draw one by one)."""
    *lead, tq, tk = w.shape
    qi = torch.arange(tq) * q_bins // tq
    ki = torch.arange(tk) * k_bins // tk
    summed = torch.zeros(*lead, tq, k_bins, dtype=w.dtype).index_add_(-1, ki, w)
    out = torch.zeros(*lead, q_bins, k_bins, dtype=w.dtype).index_add_(-2, qi, summed)
    counts = torch.bincount(qi, minlength=q_bins).to(w.dtype)
    return out / counts[:, None]


def _stats_json(stats: list[Any]) -> list[dict[str, Any]]:
    def num(x: float) -> float | None:
        return None if math.isnan(x) else round(float(x), 4)

    return [{"layer": s.layer, "head": s.head, "entropy_nats": num(s.entropy_nats), "entropy": num(s.entropy),
             "max_prob": num(s.max_prob), "flag": s.flag} for s in stats]


def _view(ld: Loaded, name: str, queries: str, keys: str, layers: list[Tensor],
          bins: tuple[int, int] | None = None) -> dict[str, Any]:
    stats = adapter.head_stats(ld, name, layers)  # on the full maps, before any pooling
    shown = [w[0].float().cpu() for w in layers]
    if bins is not None:
        shown = [pool(w, *bins) for w in shown]
    return {"name": name, "queries": queries, "keys": keys, "causal": adapter.causal(ld, name),
            "layers": [rounded(w) for w in shown], "stats": _stats_json(stats)}


def check_size(ld: Loaded, shapes: list[tuple[int, int, int]]) -> None:
    """shapes: (layers, queries, keys) per view. Refuse an input whose maps would be too large to send and
    draw, before computing them."""
    h = adapter.n_heads(ld)
    total = sum(n * h * q * k for n, q, k in shapes)
    if total > MAX_WEIGHTS:
        worst = max(shapes, key=lambda s: s[1] * s[2])
        raise ExploreError(f"this input gives {total:,} attention weights to draw ({len(shapes)} view(s), "
                           "e.g. "
                           f"{worst[0]} layers x {h} heads x {worst[1]} x {worst[2]}); the explorer draws at "
                           f"most {MAX_WEIGHTS:,}: shorten the input")


def analyze(ld: Loaded, text: str = "", *, target: str | None = None, image_index: int = 0,
            wav_base64: str | None = None, max_target_tokens: int = 32) -> dict[str, Any]:
    """Attention of every layer and head for one input. Returns {"tokens": {role: labels}, "views": [...],
    "image"?: {...}, "audio"?: {...}}; a view is one attention kind with layers[L][H][Tq][Tk] and stats."""
    m = ld.model
    dev = next(m.parameters()).device
    with ld.lock, torch.no_grad():
        if adapter.input_kind(ld) == "text+image":
            return _analyze_image_question(ld, text, image_index, max_target_tokens)
        if ld.kind in ("decoder", "encoder"):
            ids, labels = adapter.tokenize(ld, text)
            adapter.check_length(len(ids), adapter.context(ld), "input")
            check_size(ld, [(adapter.n_layers(ld), len(ids), len(ids))])
            maps = adapter.attention(ld, {"input_ids": torch.tensor([ids], device=dev)})
            return {"tokens": {"input": labels}, "ids": {"input": ids},
                    "views": [_view(ld, "self", "input", "input", maps["self"])]}
        if ld.kind == "seq2seq":
            ids, labels = adapter.tokenize(ld, text, "source")
            adapter.check_length(len(ids), adapter.context(ld), "source")
            src = torch.tensor([ids], device=dev)
            t_ids = _target_ids(ld, src, target, max_target_tokens)
            S, T = len(ids), len(t_ids)
            Le, Ld = adapter.n_layers(ld, "encoder"), adapter.n_layers(ld, "decoder")
            check_size(ld, [(Le, S, S), (Ld, T, T), (Ld, T, S)])
            dec = torch.tensor([t_ids], device=dev)
            maps = adapter.attention(ld, {"input_ids": src, "decoder_input_ids": dec})
            t_labels = [adapter.label(ld, i) for i in t_ids]
            return {"tokens": {"source": labels, "target": t_labels}, "ids": {"source": ids, "target": t_ids},
                    "views": [_view(ld, "encoder self", "source", "source", maps["encoder self"]),
                              _view(ld, "decoder self", "target", "target", maps["decoder self"]),
                              _view(ld, "cross", "target", "source", maps["cross"])]}
        if ld.kind == "image":
            px, caption = adapter.image(ld, image_index)
            px = px.to(dev)
            n = adapter.context(ld)
            check_size(ld, [(adapter.n_layers(ld), n, n)])
            maps = adapter.attention(ld, {"pixel_values": px})
            c = adapter.config(ld)
            cls = c.pooling == "cls"
            labels = (["CLS"] if cls else []) + [f"{r},{q}" for r in range(c.grid) for q in range(c.grid)]
            pred = m(pixel_values=px).logits[0].softmax(-1)
            return {"tokens": {"input": labels}, "views": [_view(ld, "self", "input", "input", maps["self"])],
                    "image": {"pixels": media.pixels_for_display(px), "grid": [c.grid, c.grid],
                              "patch_size": c.patch_size, "cls": cls, "caption": caption,
                              "prediction": int(pred.argmax()), "confidence": round(float(pred.max()), 4)}}
        if ld.kind == "audio":
            return _analyze_audio(ld, text, target, wav_base64, max_target_tokens)
    raise ExploreError(f"cannot analyse a model of kind {ld.kind!r}")  # pragma: no cover


def _analyze_image_question(ld: Loaded, text: str, image_index: int, max_new: int) -> dict[str, Any]:
    """A vision-language model: its greedy answer to the question about a built-in image, the rows of the
    queries that chose the answer's tokens over every position (view "answer"), and on the image the mean
    over layers, heads and answer tokens of the attention on each patch (experiments.vlm_attention)."""
    res, caption = adapter.image_question(ld, text, image_index, max_new)
    ids, rows = res.prompt_ids + res.answer_ids, res.query_rows()
    check_size(ld, [(adapter.n_layers(ld), len(rows), len(ids))])
    grid = list(res.grid.shape)
    full = res.class_share is not None  # the first placeholder holds CLIP's class token
    where = {p: f"img {k // grid[1]},{k % grid[1]}" for k, p in enumerate(res.image_positions[int(full):])}
    labels = [where.get(i) or adapter.label(ld, t) for i, t in enumerate(ids)]
    pixels = media.pixels_for_display(res.pixel_values)
    view = _view(ld, "answer", "answer", "input", [w[:, :, rows] for w in res.attentions])
    return {"tokens": {"answer": [adapter.label(ld, t) for t in res.answer_ids], "input": labels},
            "ids": {"input": ids, "answer": res.answer_ids}, "views": [view],
            "image": {"pixels": pixels, "grid": grid, "patch_size": len(pixels[0]) // grid[1], "cls": False,
                      "offset": res.image_positions[0] + int(full), "caption": caption,
                      "attention": rounded(res.grid), "image_share": round(res.image_share, 5)}}


def _target_ids(ld: Loaded, src: Tensor, target: str | None, max_new: int) -> list[int]:
    """The decoder input the maps are drawn for, as `qkv attention` builds it: a typed target teacher-forced
    ([decoder start] + its label ids, less a final eos: experiments.attention.teacher_forced_input),
    or [decoder start] + the greedy output."""
    tctx = adapter.target_context(ld)
    if target is not None and target.strip():
        t_ids = adapter.teacher_forced_target(ld, target)
    else:
        t_ids = adapter.greedy_target(ld, src, min(max_new, tctx - 1))
    adapter.check_length(len(t_ids), tctx, "target (with its start token)")
    return t_ids


def _analyze_audio(ld: Loaded, text: str, target: str | None, wav: str | None,
                   max_new: int) -> dict[str, Any]:
    dev = next(ld.model.parameters()).device
    audio, caption = media.audio(ld, text, wav)
    audio = audio.to(dev)
    t_ids = _target_ids(ld, audio, target, max_new)
    maps = adapter.attention(ld, {"audio": audio, "decoder_input_ids": torch.tensor([t_ids], device=dev)})
    frames = maps["encoder self"][0].shape[-1]
    bins = min(frames, MAX_AUDIO_BINS)
    sec = media.frame_seconds(ld) * frames / bins
    frame_labels = [f"{i * sec:.2f}s" for i in range(bins)]
    t_labels = [adapter.label(ld, i) for i in t_ids]
    enc = _view(ld, "encoder self", "source", "source", maps["encoder self"], (bins, bins))
    cross = _view(ld, "cross", "target", "source", maps["cross"], (len(t_ids), bins))
    return {"tokens": {"source": frame_labels, "target": t_labels}, "ids": {"target": t_ids},
            "views": [enc, _view(ld, "decoder self", "target", "target", maps["decoder self"]), cross],
            "audio": {"caption": caption,
                      "seconds": round(audio.shape[-1] / adapter.config(ld).sample_rate, 3),
                      "frames": frames, "bins": bins, "audio_frames": media.audio_frames(ld, audio)}}


# -- generation --------------------------------------------------------------------------------------------
def generation(ld: Loaded, text: str = "", *, max_new_tokens: int = 16, do_sample: bool = False,
               temperature: float = 1.0, top_k: int | None = None, seed: int = 0, block_size: int = 16,
               wav_base64: str | None = None) -> dict[str, Any]:
    """Each generated token with the attention row that chose it (every layer and head), the 10 most likely
    next tokens, and the KV cache after the step (bytes per layer: static allocation, used, paged)."""
    if not adapter.can_generate(ld):
        raise ExploreError(f"a {ld.kind} model does not generate tokens")
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise ExploreError(f"max_new_tokens must be between 1 and {MAX_NEW_TOKENS}")
    if not 1 <= block_size <= 1024:
        raise ExploreError("block_size must be between 1 and 1024")
    adapter.check_sampling(temperature=temperature, top_k=top_k)
    dev = next(ld.model.parameters()).device
    with ld.lock, torch.no_grad():
        source: list[str] | None = None
        if ld.kind == "decoder":
            ids, _ = adapter.tokenize(ld, text, "prompt")
            ids = adapter.prompt_ids(ld, ids)
            ctx = adapter.context(ld)
            adapter.check_length(len(ids) + 1, ctx, "prompt plus one new token")
            src = torch.tensor([ids], device=dev)
            max_new_tokens = min(max_new_tokens, ctx - len(ids))
        elif ld.kind == "seq2seq":
            ids, source = adapter.tokenize(ld, text, "source")
            adapter.check_length(len(ids), adapter.context(ld), "source")
            src = torch.tensor([ids], device=dev)
            max_new_tokens = min(max_new_tokens, adapter.target_context(ld) - 1)
        else:
            src, _ = media.audio(ld, text, wav_base64)
            src = src.to(dev)
            max_new_tokens = min(max_new_tokens, adapter.target_context(ld) - 1)
        prefix, steps, spec = adapter.generate_steps(ld, src, max_new_tokens, do_sample=do_sample,
                                                     temperature=temperature, top_k=top_k, seed=seed,
                                                     block_size=block_size)
    per_pos = spec.position_bytes  # K and V (or an MLA latent) of one position, one layer
    out_steps = []
    for s in steps:
        p = s.logits.double().softmax(-1)
        top = torch.topk(p, min(10, p.numel()))
        out_steps.append({
            "token": s.token, "label": adapter.label(ld, s.token),
            "rows": {kind: [rounded(layer[kind]) for layer in s.rows] for kind in s.rows[0]},
            "top": [{"id": int(i), "label": adapter.label(ld, int(i)), "p": round(float(v), 5)}
                    for v, i in zip(top.values, top.indices)],
            "cache": {"positions": s.positions, "used_per_layer": per_pos * s.positions,
                      "static_per_layer": spec.static_bytes // spec.n_layers,
                      "paged_blocks": s.paged_blocks,
                      "paged_per_layer": s.paged_blocks * spec.paged_bytes_per_block // spec.n_layers}})
    return {"prefix": [adapter.label(ld, i) for i in prefix], "prefix_ids": prefix, "source": source,
            "steps": out_steps,
            "cache": {"n_layers": spec.n_layers, "n_kv_heads": spec.n_kv_heads, "head_dim": spec.head_dim,
                      "dtype": spec.dtype, "dtype_bytes": spec.dtype_bytes,
                      "bytes_per_position_per_layer": per_pos,
                      "static_positions": spec.static_positions, "static_bytes": spec.static_bytes,
                      "block_size": spec.block_size, "paged_bytes_per_block": spec.paged_bytes_per_block,
                      "cross_bytes": spec.cross_bytes}}


# -- positional encodings ----------------------------------------------------------------------------------
def _cosine(table: Tensor) -> Tensor:
    t = torch.nn.functional.normalize(table.double(), dim=-1)
    return t @ t.T


def positions(ld: Loaded) -> dict[str, Any]:
    """The model's positional encodings as pictures: tables (position x dimension) with the cosine similarity
    between positions, RoPE's rotation angles and its dot product by distance, ALiBi's slopes and bias."""
    out = []
    for e in adapter.position_encodings(ld):
        item: dict[str, Any] = {"where": e["where"], "kind": e["kind"]}
        if "table" in e:
            t = e["table"]
            n = min(t.shape[0], TABLE_POSITIONS)
            item.update(n_positions=int(t.shape[0]), d_model=int(t.shape[1]),
                        table=rounded(t[:n, :TABLE_DIMS], 4), similarity=rounded(_cosine(t[:n]), 4))
            if "grid" in e:
                item["grid"] = e["grid"]
        if e["kind"] == "rope":
            item.update(head_dim=e["head_dim"], base=e["base"], inv_freq=[float(f) for f in e["inv_freq"]],
                        cos=rounded(e["cos"], 4), dot_by_distance=rounded(e["dot_by_distance"], 4))
        if e["kind"] == "alibi":
            item.update(slopes=rounded(e["slopes"], 10), bias=rounded(e["bias"], 4))
        out.append(item)
    return {"encodings": out}


def info(ld: Loaded) -> dict[str, Any]:
    """What the page needs before the first request: the model's facts and what input it takes."""
    d = adapter.describe(ld)
    d.update(name=ld.name, input=adapter.input_kind(ld), context=adapter.context(ld),
             target_context=adapter.target_context(ld), can_generate=adapter.can_generate(ld),
             max_new_tokens=MAX_NEW_TOKENS,
             images=adapter.sample_images(ld) if adapter.input_kind(ld) in ("image", "text+image") else 0,
             renders_text=ld.kind == "audio" and ld.task is not None and hasattr(ld.task, "render"))
    return d
