"""Attention maps: every layer x head, with token labels, for encoder self-, decoder self- and
cross-attention.

The maps are the naive backend's softmax probabilities (a model built with attention='fused' falls back to
the naive path when weights are requested, PyTorch #98505): rows sum to 1 over the keys a query may see,
and masked keys (future tokens, padding) are exactly 0.

  collect_attentions(model, inputs)  -> {"self" | "encoder self" | "decoder self" | "cross": [(B, H, Tq, Tk)]
  per layer} attention_maps(model, tokenizer_or_ids, text, out_png) -> AttentionMaps (PNG paths, per-head
  entropy, tokens)
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers
import torch
from torch import Tensor, nn

import qkv
from qkv.experiments.head_stats import HeadStat, flag_heads, head_stats
from qkv.generate import generate
from qkv.generate.search import settings
from qkv.interop.tokenizer import bare_tokenizer
from qkv.models.decoding import as_decoder
from qkv.nn.attention import MultiHeadAttention, causal_mask
from qkv.tasks.tokenizers import Tokenizer, find_tokenizer

_FORWARD_ONLY = ("labels",)  # dropped: the maps need no loss


def _is_encdec(model: nn.Module) -> bool:
    return hasattr(model, "encode") and hasattr(model, "decode")


@torch.no_grad()
def collect_attentions(model: nn.Module, inputs: dict[str, Tensor] | Tensor) -> dict[str, list[Tensor]]:
    """Run the model once in eval mode (no dropout) and return its attention probabilities by kind.

    Decoder-only models give {"self": ...}; encoder-only {"self": ...}; encoder-decoder models
    {"encoder self", "decoder self", "cross"}. Each list has one (B, H, Tq, Tk) tensor per layer."""
    batch = {"input_ids": inputs} if isinstance(inputs, Tensor) else {k: v for k, v in inputs.items()
                                                                       if k not in _FORWARD_ONLY}
    if "input_ids" not in batch:
        raise ValueError("attention maps need input_ids")
    was_training = model.training
    model.eval()
    try:
        if _is_encdec(model) and "decoder_input_ids" not in batch:
            raise ValueError("an encoder-decoder model needs decoder_input_ids for attention maps")
        out = model(**batch, return_attentions=True)
    finally:
        model.train(was_training)
    result: dict[str, list[Tensor]] = {}
    if out.attentions is None:
        raise ValueError(f"{type(model).__name__} returned no attention weights")
    if out.encoder_attentions is not None:
        result["encoder self"] = [layer["self"] for layer in out.encoder_attentions]
        result["decoder self"] = [layer["self"] for layer in out.attentions]
        if out.attentions and "cross" in out.attentions[0]:
            result["cross"] = [layer["cross"] for layer in out.attentions]
    else:
        result["self"] = [layer["self"] for layer in out.attentions]
    return result


def visible_keys(
    model: nn.Module, kind: str, inputs: dict[str, Tensor] | Tensor, q_len: int, k_len: int
) -> Tensor:
    """(B|1, 1, Tq, Tk) bool: which keys each query of attention `kind` may see (causal and padding masks),
    for head statistics. Decoder self-attention (and a decoder-only model's "self") is causal."""
    batch = {"input_ids": inputs} if isinstance(inputs, Tensor) else inputs
    device = batch["input_ids"].device
    if kind == "cross" or kind == "encoder self":
        pad = batch.get("attention_mask")
    elif kind == "decoder self":
        pad = batch.get("decoder_attention_mask")
    else:
        pad = batch.get("attention_mask")
    causal = kind == "decoder self" or (kind == "self" and not _is_encdec(model) and _is_causal(model))
    vis = torch.ones(1, 1, q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        vis = vis & causal_mask(q_len, k_len, device)
    if pad is not None:
        vis = vis & pad.bool()[:, None, None, :]
    return vis


def _is_causal(model: nn.Module) -> bool:
    return any(m.causal for m in model.modules() if isinstance(m, MultiHeadAttention))


# -- tokens ------------------------------------------------------------------------------------------------
def tokenize(tokenizer_or_ids: Any, text: str | None) -> tuple[list[int], list[str]]:
    """Token ids and display labels from: a list/tensor of ids (text ignored), a Hugging Face `tokenizers`
    Tokenizer, a transformers tokenizer, or any object with encode(text) -> list[int] (and optionally
    decode / id_to_token)."""
    tok = tokenizer_or_ids
    if isinstance(tok, Tensor):
        ids = tok.flatten().tolist()
        return ids, [str(i) for i in ids]
    if isinstance(tok, (list, tuple)):
        ids = [int(i) for i in tok]
        return ids, [str(i) for i in ids]
    if text is None:
        raise ValueError("a tokenizer needs the input text")
    if isinstance(tok, tokenizers.Tokenizer):  # a bare one: its encode gives an Encoding, not ids
        tok = bare_tokenizer(tok)
    enc = tok.encode(text)  # a TextTokenizer's ids, or a transformers tokenizer's (a list or a tensor)
    ids = [int(i) for i in (enc.tolist() if isinstance(enc, Tensor) else enc)]
    return ids, [token_label(tok, i) for i in ids]


def token_label(tok: Any, i: int) -> str:
    for name in ("id_to_token", "convert_ids_to_tokens"):
        fn = getattr(tok, name, None)
        if fn is not None:
            try:
                s = fn(i)
                if s is not None:
                    return str(s)
            except Exception:  # noqa: BLE001  (a tokenizer without that id: fall back)
                pass
    # qkv's tokenizers name the flag skip_special, Hugging Face's skip_special_tokens: show <sep>, <eos>, ...
    for kwargs in ({"skip_special": False}, {"skip_special_tokens": False}, {}):
        try:
            s = str(tok.decode([i], **kwargs))
            return s if s.strip() else repr(s)
        except TypeError:
            continue
        except Exception:  # noqa: BLE001  (no decode, or not for that id: the id itself)
            break
    return str(i)


def _decoding_settings(model: nn.Module) -> Any:
    """The model's resolved generation settings (a Hugging Face folder's generation_config.json included):
    where its decoder starts and which ids end a sequence, as qkv.generate reads them."""
    return settings(as_decoder(model), None, {})


def decoder_start(model: nn.Module) -> int:
    """The encoder-decoder's first decoder token: decoder_start_token_id, else bos_token_id (as generate)."""
    cfg = _decoding_settings(model)
    start = cfg.decoder_start_token_id if cfg.decoder_start_token_id is not None else cfg.bos_token_id
    if start is None:
        raise ValueError("this encoder-decoder has no decoder_start_token_id (or bos_token_id) to start from")
    return int(start)


def teacher_forced_input(model: nn.Module, target_ids: list[int]) -> list[int]:
    """The decoder input that teacher forcing on `target_ids` (labels, with the tokenizer's special tokens)
    feeds: [decoder start] + the labels, less a final eos. This is transformers' shift_tokens_right for labels
    that end in eos (every T5 / BART / Marian tokenizer appends one): the eos is only ever predicted, never
    read. Labels without a final eos are kept whole."""
    ids = [int(i) for i in target_ids]
    if ids and ids[-1] in _decoding_settings(model).eos_ids:
        ids = ids[:-1]
    return [decoder_start(model), *ids]


@torch.no_grad()
def greedy_target(model: nn.Module, src: Tensor, max_new_tokens: int = 32) -> Tensor:
    """Decoder input for an encoder-decoder's maps when no target is given: [decoder start] + the greedy
    output, from qkv.generate under the model's settings (decoder_start_token_id, forced BOS / EOS, banned
    words, min length of a Hugging Face folder's generation_config.json): the sequence `qkv generate --greedy`
    decodes, beams and sampling aside."""
    limit = as_decoder(model).context_limit  # the start token takes one decoder position
    n = max_new_tokens if limit is None else max(1, min(max_new_tokens, limit - 1))
    out = generate(model, src, max_new_tokens=n, do_sample=False, num_beams=1, num_return_sequences=1)
    # generate returns the target without its start token (rows that stop early are padded after their eos)
    return torch.cat([torch.full_like(out[:, :1], decoder_start(model)), out], dim=1)


def target_token_ids(tok: Any, text: str) -> list[int]:
    """A target sentence's ids as labels: the tokenizer's target side (Marian's target.spm) when it has one,
    with the special tokens its post-processor adds (as transformers' `text_target=`)."""
    encode = getattr(tok, "encode_target", None) or tok.encode
    return [int(i) for i in encode(text)]


# -- plotting ----------------------------------------------------------------------------------------------
@dataclass
class AttentionMaps:
    pngs: list[Path]
    stats: list[HeadStat]
    tokens: dict[str, list[str]] = field(default_factory=dict)  # "source"/"target"/"input" -> labels
    json_path: Path | None = None

    def entropy_table(self) -> str:
        lines = ["| attention | layer | head | entropy (nats) | entropy / log n | mean max p | flag |",
                 "|---|---|---|---|---|---|---|"]
        for s in self.stats:
            lines.append(f"| {s.kind} | {s.layer} | {s.head} | {s.entropy_nats:.3f} | {s.entropy:.3f} | "
                         f"{s.max_prob:.3f} | {s.flag} |")
        return "\n".join(lines)


def image_path(out: str | Path) -> Path:
    """The file a figure is written to: `out`, with .png added when it has no extension (matplotlib would add
    it silently, and the path printed would not be the file written); an existing folder, or a file where a
    folder above it should be, is a one-line error before any work."""
    out = Path(out)
    if out.is_dir():
        raise ValueError(
            f"{out} is a folder, not an image file: give a file name, e.g. {out / 'attention.png'}"
        )
    if not out.suffix:
        out = out.with_name(out.name + ".png")
    for p in out.parents:
        if p.exists() and not p.is_dir():
            raise ValueError(f"cannot write {out}: {p} is a file, not a folder")
    return out


def plot_grid(maps: list[Tensor], q_labels: list[str], k_labels: list[str], title: str, out_png: Path,
              stats: list[HeadStat] | None = None, max_label_tokens: int = 48) -> Path:
    """One PNG: rows = layers, columns = heads; each cell the (Tq, Tk) map of batch item 0."""
    import matplotlib  # noqa: PLC0415  (matplotlib: slow to import, only for plots)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    n_layers, n_heads = len(maps), maps[0].shape[1]
    tq, tk = maps[0].shape[2], maps[0].shape[3]
    cell = max(1.6, min(4.0, 0.18 * max(tq, tk)))
    fig, axes = plt.subplots(n_layers, n_heads, figsize=(cell * n_heads + 0.5, cell * n_layers + 0.8),
                             squeeze=False)
    by_key = {(s.layer, s.head): s for s in (stats or [])}
    show_labels = max(tq, tk) <= max_label_tokens
    for i, w in enumerate(maps):
        for h in range(n_heads):
            ax = axes[i][h]
            ax.imshow(w[0, h].float().cpu().numpy(), vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
            s = by_key.get((i, h))
            sub = f"L{i} H{h}" + (
                f"  H={s.entropy_nats:.2f}" if s is not None and not math.isnan(s.entropy_nats) else ""
            )
            if s is not None and s.flag:
                sub += f" [{s.flag}]"
            ax.set_title(sub, fontsize=7)
            if show_labels:
                ax.set_xticks(range(tk))
                ax.set_xticklabels(k_labels[:tk], rotation=90, fontsize=5)
                ax.set_yticks(range(tq))
                ax.set_yticklabels(q_labels[:tq], fontsize=5)
            else:
                ax.set_xticks([])
                ax.set_yticks([])
    fig.suptitle(f"{title} (rows: layers, columns: heads; query down, key across; H = row entropy, nats)",
                 fontsize=9)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png


def attention_maps(
    model: nn.Module, tokenizer_or_ids: Any, text: str | None, out_png: str | Path, *,
    target: str | list[int] | None = None, target_tokenizer: Any = None, max_new_tokens: int = 32,
    labels: list[str] | None = None,
) -> AttentionMaps:
    """Plot every layer x head attention map for one input.

    tokenizer_or_ids: a tokenizer (see `tokenize`) applied to `text`, or the token ids themselves.
    Encoder-decoder models: the decoder input is [decoder start] + `target` (text, or its ids, with the
    tokenizer's special tokens) less its final eos, as teacher forcing on it as labels (transformers'
    shift_tokens_right); without a target, [decoder start] + the greedy output of qkv.generate under the
    model's generation settings (eos included), i.e. what `qkv generate --greedy` decodes. out_png: for a
    single attention kind, that file; otherwise one
    file per kind named <stem>_<kind>.png next to it. Also writes <stem>_entropy.json (per-head stats).
    labels: display labels of the input tokens (default: from the tokenizer, or the ids themselves)."""
    out_png = image_path(out_png)
    ids, tok_labels = tokenize(tokenizer_or_ids, text)
    if not ids:
        raise ValueError("the input has no tokens")
    if labels is not None and len(labels) != len(ids):
        raise ValueError(f"labels has {len(labels)} entries for {len(ids)} tokens")
    labels = labels if labels is not None else tok_labels
    device = next(model.parameters()).device
    src = torch.tensor([ids], dtype=torch.long, device=device)
    tokens = {"input": labels}
    if _is_encdec(model):
        label_tok = target_tokenizer or tokenizer_or_ids
        ids_only = isinstance(label_tok, (list, tuple, Tensor))
        if target is None:
            was = model.training
            model.eval()
            t_ids = greedy_target(model, src, max_new_tokens)[0].tolist()
            model.train(was)
        elif isinstance(target, str):
            if ids_only:
                raise ValueError("a text target needs a tokenizer: give the target as token ids")
            t_ids = teacher_forced_input(model, target_token_ids(label_tok, target))
        else:
            t_ids = teacher_forced_input(model, list(target))
        t_labels = [str(i) if ids_only else token_label(label_tok, i) for i in t_ids]
        tokens = {"source": labels, "target": t_labels}
        batch = {
            "input_ids": src,
            "decoder_input_ids": torch.tensor([t_ids], dtype=torch.long, device=device),
        }
    else:
        batch = {"input_ids": src}
    maps = collect_attentions(model, batch)
    stats: list[HeadStat] = []
    pngs: list[Path] = []
    for kind, layers in maps.items():
        kind_stats = []
        vis = visible_keys(model, kind, batch, layers[0].shape[-2], layers[0].shape[-1])
        for i, w in enumerate(layers):
            kind_stats.extend(head_stats(w, kind, i, vis))
        flag_heads(kind_stats)
        stats.extend(kind_stats)
        if kind == "self":
            ql = kl = tokens["input"]
        elif kind == "encoder self":
            ql = kl = tokens["source"]
        elif kind == "decoder self":
            ql = kl = tokens["target"]
        else:  # cross: decoder queries over encoder keys
            ql, kl = tokens["target"], tokens["source"]
        path = (
            out_png if len(maps) == 1 else out_png.with_name(f"{out_png.stem}_{kind.replace(' ', '_')}.png")
        )
        pngs.append(plot_grid(layers, ql, kl, f"{type(model).__name__} {kind}-attention", path, kind_stats))
    js = out_png.with_name(f"{out_png.stem}_entropy.json")
    js.write_text(
        json.dumps({"tokens": tokens, "heads": [s.__dict__ for s in stats]}, indent=1), encoding="utf-8"
    )
    return AttentionMaps(pngs, stats, tokens, js)


# -- the `qkv attention CHECKPOINT --input TEXT` entry point ------------------------------------------------
def attention_from_checkpoint(checkpoint: str | Path, text: str, out_png: str | Path, *,
                              target: str | None = None, max_new_tokens: int = 32,
                              model: nn.Module | None = None) -> AttentionMaps:
    """Load a qkv or Hugging Face checkpoint folder (qkv.from_pretrained; `model`: the one already loaded from
    it, not loaded twice) and its tokenizer, and plot the attention maps of `text`. Without a tokenizer,
    `text` must be whitespace-separated token ids. Symbols a character/word vocabulary lacks (read as <unk>)
    are named in a warning."""
    model = model if model is not None else qkv.from_pretrained(checkpoint)
    tok = find_tokenizer(checkpoint)
    unknown = tok.unknown_symbols(text + (target or "")) if isinstance(tok, Tokenizer) else []
    if unknown:
        shown = ", ".join(repr(u) for u in unknown[:10]) + (" ..." if len(unknown) > 10 else "")
        warnings.warn(f"{len(unknown)} symbol(s) outside the model's vocabulary, drawn as <unk>: {shown}",
                      stacklevel=2)
    if tok is None:
        try:
            ids = [int(t) for t in text.split()]
        except ValueError:
            raise ValueError(
                f"no tokenizer found with {checkpoint}; pass the input as token ids, e.g. '5 3 9'"
            ) from None
        return attention_maps(
            model,
            ids,
            None,
            out_png,
            target=[int(t) for t in target.split()] if target else None,
            max_new_tokens=max_new_tokens,
        )
    return attention_maps(model, tok, text, out_png, target=target, max_new_tokens=max_new_tokens)
