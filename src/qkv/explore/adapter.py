"""The one place where the explorer touches qkv's models, tasks, tokenizers and caches.

Everything else in `qkv.explore` works on what this module returns (ids, labels, attention tensors, cache
byte counts, position tables), so when the model interfaces change (a decoder protocol, model kinds, a
generation config) only this file changes. What it reuses:

  loading          run.load_model_any / run_folder_of / load_run_task, tasks.tokenizers.find_tokenizer
  attention        experiments.attention.collect_attentions / visible_keys / greedy_target (naive softmax)
  statistics       experiments.diagnostics.head_stats / flag_heads
  generation       qkv.generate.generate(..., return_attentions=True)
  caches           model.make_cache / make_paged_cache (per-head K/V, or an MLA model's latent caches)
  positions        the stacks' PositionalEncoding objects (nn/position.py) and the family tables that still
                   live outside the hooks (ViT's patch table, Whisper's audio sinusoids)

Audio in, and an image's pixels for the page: explore/media.py. What qkv does not compute and this file
does: the per-step next-token probabilities (generate() returns no scores: a replay of the generated tokens
through a real PagedKVCache gives the logits and the paged block counts in one pass).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from qkv.config import ConfigError
from qkv.experiments import diagnostics
from qkv.experiments.attention import collect_attentions, teacher_forced_input, token_label
from qkv.experiments.attention import greedy_target as greedy
from qkv.experiments.attention import target_token_ids as label_ids
from qkv.experiments.attention import tokenize as tokenize_any
from qkv.experiments.attention_report import UNSUPPORTED
from qkv.experiments.vlm_attention import image_attention
from qkv.explore.loaded import ExploreError, Loaded, config
from qkv.generate import GenerationConfig, generate
from qkv.interop.llava import ImageProcessor
from qkv.interop.tokenizer import load_hf_tokenizer
from qkv.nn.attention import causal_mask
from qkv.nn.position import ALiBi, Learned, PatchGrid, RoPE, Sinusoidal
from qkv.run import load_model_any, load_run_task, model_folder, run_folder_of
from qkv.storage import atomic_write_text as atomic_write_text  # for export.py: one atomic writer
from qkv.tasks.digits import load_digit_images
from qkv.tasks.seq2seq import PairTask
from qkv.tasks.tokenizers import SEP, CharTokenizer, find_tokenizer

# the kinds the explorer has views for (a model declares its kinds: qkv.models.registry); it branches on the
# kind only, never on the family
SHOWN_KINDS = ("decoder", "seq2seq", "encoder", "image", "audio")
MAX_PROMPT_BYTES = 20_000  # a request larger than this is refused before tokenising
POSITIONS_SHOWN = 64  # positions drawn in the RoPE pictures


def load(path: str | Path, quantize: str | None = None) -> Loaded:
    """A qkv run folder, a qkv checkpoint folder or a Hugging Face folder qkv loads (gpt2, bert, vit,
    whisper); quantize: "int8" / "int4" weight-only (qkv.nn.quant)."""
    path = Path(path)
    model = load_model_any(path, quantize)
    model.eval()
    family = getattr(model, "family", "") or type(model).__name__.lower()
    if family in UNSUPPORTED:
        raise ExploreError(f"{path}: {UNSUPPORTED[family]}")
    kind = getattr(model, "kind", None)
    if kind not in SHOWN_KINDS:
        raise ExploreError(f"{path}: the explorer shows {', '.join(SHOWN_KINDS)} models, not a {kind} model "
                           f"(family {family!r})")
    task = load_run_task(path) if run_folder_of(path) is not None else None
    tok = getattr(task, "tokenizer", None) if task is not None else None
    folder = model_folder(path)
    if tok is None and kind != "image":
        tok = find_tokenizer(folder)
    vision = None
    if hasattr(model, "image_features"):  # a vision-language model (LLaVA): questions about an image

        vision = (load_hf_tokenizer(folder), ImageProcessor.from_folder(folder))
    return Loaded(model, path.name or str(path), family, kind, tok, task, folder, vision)


# -- model facts -------------------------------------------------------------------------------------------
def stacks(ld: Loaded) -> dict[str, Any]:
    """The model's Stacks by role: {"decoder": ...} / {"encoder": ...} / both."""
    m = ld.model.language_model if ld.vision is not None else ld.model
    return {name: getattr(m, name) for name in ("encoder", "decoder") if getattr(m, name, None) is not None}


def n_layers(ld: Loaded, role: str | None = None) -> int:
    """Blocks of the "encoder" or "decoder" stack (default: the model's only stack)."""
    s = stacks(ld)
    return len((s[role] if role is not None else next(iter(s.values()))).blocks)


def n_heads(ld: Loaded) -> int:
    return int(config(ld).n_heads)


def context(ld: Loaded) -> int:
    """Most tokens the input side accepts (source for seq2seq, patches for ViT)."""
    c = config(ld)
    if ld.kind == "image":
        return c.grid ** 2 + (1 if c.pooling == "cls" else 0)
    if ld.kind == "audio":
        return int(c.n_audio_ctx)
    return int(c.context_length)


def target_context(ld: Loaded) -> int | None:
    """Most decoder positions of a seq2seq model (None for the others)."""
    return int(config(ld).context_length) if ld.kind in ("seq2seq", "audio") else None


def vocab_size(ld: Loaded) -> int | None:
    c = config(ld)
    for name in ("src_vocab_size", "vocab_size"):
        if hasattr(c, name):
            return int(getattr(c, name))
    return None


def can_generate(ld: Loaded) -> bool:
    return ld.kind in ("decoder", "seq2seq", "audio")


def input_kind(ld: Loaded) -> str:
    """text | ids (no tokenizer) | image | audio | text+image (a question about an image)."""
    if ld.vision is not None:
        return "text+image"
    if ld.kind == "image":
        return "image"
    if ld.kind == "audio":
        return "audio"
    return "text" if ld.tokenizer is not None else "ids"


def describe(ld: Loaded) -> dict[str, Any]:
    """Facts about the model shown in the page's header."""
    c = config(ld)
    layers = {role: len(s.blocks) for role, s in stacks(ld).items()}
    return {"family": ld.family, "kind": ld.kind, "class": type(ld.model).__name__,
            "parameters": int(ld.model.num_parameters()), "d_model": int(c.d_model), "n_heads": n_heads(ld),
            "n_kv_heads": int(getattr(c, "n_kv_heads", None) or c.n_heads), "layers": layers,
            "position": str(getattr(c, "position", "")), "placement": str(getattr(c, "placement", "")),
            "attention": str(getattr(c, "attention", "")),
            "dtype": str(next(ld.model.parameters()).dtype).replace("torch.", "")}


# -- text -> tokens ----------------------------------------------------------------------------------------
def _display(label: str) -> str:
    """Whitespace made visible: byte-level BPE's 'Ġ' (a leading space) and 'Ċ' (newline), and a plain
    space, newline or tab, become ␣, ↵ and ⇥."""
    for a, b in (("Ġ", "␣"), ("Ċ", "↵"), (" ", "␣"), ("\n", "↵"), ("\t", "⇥")):
        label = label.replace(a, b)
    return label


def _tokens_from_ids(ld: Loaded, text: str, what: str, vocab: int | None) -> tuple[list[int], list[str]]:
    try:
        ids = [int(t) for t in text.split()]
    except ValueError:
        raise ExploreError(f"this model folder has no tokenizer: type the {what} as token ids separated by "
                           "spaces, e.g. '5 3 9'") from None
    bad = [i for i in ids if vocab is not None and not 0 <= i < vocab]
    if bad:
        raise ExploreError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    return ids, [str(i) for i in ids]


def tokenize(ld: Loaded, text: str, what: str = "input",
             vocab: int | None = None) -> tuple[list[int], list[str]]:
    """Ids and display labels of `text`. Empty text and characters a character/word tokenizer does not know
    are errors (a char tokenizer would otherwise silently turn them into <unk>)."""
    if not text or not text.strip():
        raise ExploreError(f"the {what} is empty: type some text")
    if len(text.encode("utf-8")) > MAX_PROMPT_BYTES:
        raise ExploreError(f"the {what} is {len(text.encode('utf-8'))} bytes; the explorer takes at most "
                           f"{MAX_PROMPT_BYTES}")
    tok = ld.tokenizer
    vocab = vocab if vocab is not None else vocab_size(ld)
    if tok is None:
        return _tokens_from_ids(ld, text, what, vocab)
    # qkv char / word tokenizer: refuse what it would map to <unk>
    if isinstance(tok, CharTokenizer):
        unknown = sorted(set(tok.unknown_symbols(text)))
        if unknown:
            shown = " ".join(repr(s) for s in unknown[:10])
            raise ExploreError(f"the {what} has {len(unknown)} symbol(s) this model's vocabulary does not "
                               f"know: {shown}")
    ids, labels = tokenize_any(tok, text)
    if isinstance(tok, CharTokenizer):  # a qkv char/word tokenizer: the symbol itself, not its repr
        labels = [tok.itos[i] for i in ids]
    if not ids:
        raise ExploreError(f"the {what} gives no tokens")
    if vocab is not None and max(ids) >= vocab:
        raise ExploreError(f"the tokenizer gave token id {max(ids)}, outside the model's vocabulary [0, "
                           f"{vocab})")
    return ids, [_display(s) for s in labels]


def label(ld: Loaded, i: int) -> str:
    tok = ld.tokenizer
    if tok is None:
        return str(i)
    itos = getattr(tok, "itos", None)
    return _display(itos[i] if itos is not None and 0 <= i < len(itos) else token_label(tok, i))


def prompt_ids(ld: Loaded, ids: list[int]) -> list[int]:
    """What the model is fed for generation: a decoder-only model trained on a (source, target) task expects
    [source, <sep>] (tasks/seq2seq.py)."""
    if ld.kind == "decoder" and isinstance(ld.task, PairTask):
        return ids + [SEP]
    return ids


def check_sampling(**settings: Any) -> None:
    """The sampling settings by GenerationConfig's rule, the one the CLI and the server use (temperature 0 is
    greedy), its message the page's error."""
    try:
        GenerationConfig(**settings)
    except ConfigError as e:
        raise ExploreError(e.named(e.field) if e.field else str(e)) from None


def check_length(n: int, limit: int | None, what: str) -> None:
    if limit is not None and n > limit:
        raise ExploreError(f"the {what} has {n} tokens but this model's context is {limit} positions; "
                           "shorten it")


# -- attention ---------------------------------------------------------------------------------------------
@torch.no_grad()
def attention(ld: Loaded, batch: dict[str, Tensor]) -> dict[str, list[Tensor]]:
    """{"self" | "encoder self" | "decoder self" | "cross": [(1, H, Tq, Tk)] per layer}: the naive softmax."""
    if ld.kind == "image":
        out = ld.model(pixel_values=batch["pixel_values"], return_attentions=True)
        return {"self": [layer["self"] for layer in out.attentions]}
    if ld.kind == "audio":
        out = ld.model(audio=batch["audio"], decoder_input_ids=batch["decoder_input_ids"],
                       return_attentions=True)
        return {"encoder self": [layer["self"] for layer in out.encoder_attentions],
                "decoder self": [layer["self"] for layer in out.attentions],
                "cross": [layer["cross"] for layer in out.attentions]}
    return collect_attentions(ld.model, batch)


def image_question(ld: Loaded, text: str, image_index: int, max_new_tokens: int) -> tuple[Any, str]:
    """A vision-language model's greedy answer to `text` about built-in image `image_index`, with the maps of
    every layer over the prompt and the answer (experiments.vlm_attention.ImageAttention), and a caption."""
    if not text or not text.strip():
        raise ExploreError("the question is empty: type one")
    picture, caption = question_image(ld, image_index)
    tok, processor = ld.vision
    return image_attention(ld.model, tok, processor, text, picture, max_new_tokens=max_new_tokens), caption


def causal(ld: Loaded, kind: str) -> bool:
    """Does attention `kind` hide the future (the decoder's self-attention)?"""
    if kind == "decoder self":
        return True
    if kind == "self":
        return bool(stacks(ld)[("decoder" if ld.kind == "decoder" else "encoder")].causal)
    return False


def head_stats(ld: Loaded, kind: str, layers: list[Tensor]) -> list[Any]:
    """experiments.diagnostics per-head statistics (entropy, mean max prob, one-hot / uniform flag)."""
    tq, tk = layers[0].shape[-2], layers[0].shape[-1]
    vis = causal_mask(tq, tk, layers[0].device)[None, None] if causal(ld, kind) else None
    stats = []
    for i, w in enumerate(layers):
        stats.extend(diagnostics.head_stats(w, kind, i, vis))
    diagnostics.flag_heads(stats)
    return stats


@torch.no_grad()
def teacher_forced_target(ld: Loaded, target: str) -> list[int]:
    """The decoder input for a typed target of a seq2seq model, as `qkv attention --target` builds it:
    [decoder start] + the target's label ids (the special tokens labels carry, e.g. BART's <s> ... </s>), less
    a final eos."""
    ids, _ = tokenize(ld, target, "target")  # its checks: empty, too long, unknown symbols, the id range
    if ld.tokenizer is not None:
        ids = label_ids(ld.tokenizer, target)
    return teacher_forced_input(ld.model, ids)


def greedy_target(ld: Loaded, src: Tensor, max_new_tokens: int) -> list[int]:
    """[bos] + the greedy output of a seq2seq model (the decoder input the maps are drawn for)."""
    if ld.kind == "audio":
        out = ld.model.generate(src, max_new_tokens)
        return [int(config(ld).bos_token_id)] + [int(i) for i in out[0].tolist()]
    return [int(i) for i in greedy(ld.model, src, max_new_tokens)[0].tolist()]


# -- generation --------------------------------------------------------------------------------------------
@dataclass
class Step:
    token: int
    rows: list[dict[str, Tensor]]  # per layer {"self": (H, Tk), "cross": (H, S)}: the query row that chose it
    logits: Tensor  # (V,) next-token logits from the replay
    positions: int  # positions in the self-attention cache when the token was chosen
    paged_blocks: int  # PagedKVCache blocks in use (all layers share the block table)


@dataclass
class CacheSpec:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype_bytes: int
    dtype: str
    static_positions: int  # what generate() preallocates (prompt + new tokens)
    static_bytes: int  # a real StaticCache's K+V bytes, all layers
    block_size: int
    paged_bytes_per_block: int  # K+V bytes of one block, all layers
    cross_bytes: int = 0  # encoder-decoders: the cross-attention K/V, projected once (all layers)
    position_bytes: int = 0  # what one position adds to one layer's cache (K+V; an MLA latent + rotary key)


@torch.no_grad()
def generate_steps(ld: Loaded, src: Tensor, max_new_tokens: int, *, do_sample: bool, temperature: float,
                   top_k: int | None, seed: int, block_size: int) -> tuple[list[int], list[Step], CacheSpec]:
    """Decode with qkv.generate(return_attentions=True), then replay the tokens through a PagedKVCache for
    the logits of each step and the blocks it holds. Returns (prefix ids, steps, cache facts): the prefix is
    the prompt (decoder-only) or [bos] (seq2seq)."""
    m = ld.model
    c = config(ld)
    seq2seq = ld.kind in ("seq2seq", "audio")
    # a qkv run's tokenizer ends sequences with <eos>; otherwise generate() takes config.eos_token_id if any
    eos = getattr(ld.tokenizer, "eos_id", None) if ld.task is not None else None
    out = generate(m, src, max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                   seed=seed, eos_token_id=eos, return_attentions=True)
    new = out.sequences[0, (0 if seq2seq else src.shape[1]):].tolist()
    new = new[: len(out.attentions)]
    prefix = [int(c.bos_token_id)] if seq2seq else [int(i) for i in src[0].tolist()]
    # the static cache generate() allocates: prefix + new positions (search.py _Setup.total); the model's
    # own caches, so that a model caching something else than per-head keys and values (an MLA latent) works
    total = len(prefix) + max_new_tokens
    static = m.make_cache(1, total)
    first_k, first_v = static.layers[0]
    L, (_, hkv, _, hd) = len(static.layers), first_k.shape
    elem = first_k.element_size()
    paged = m.make_paged_cache(-(-total // block_size), block_size, dtype=first_k.dtype,
                               device=first_k.device)
    paged.add_sequence(0)
    paged.set_active([0])
    memory = None
    if seq2seq:
        memory, _ = m.encode(src)
    steps: list[Step] = []
    fed = torch.tensor([prefix], dtype=torch.long, device=src.device)
    for s, tok in enumerate(new):
        if seq2seq:
            logits, _ = m.decode(fed, memory, cache=paged, last_only=True)
        else:
            logits = m(fed, cache=paged, last_only=True).logits
        rows = [{k: w[0, :, -1].float() for k, w in layer.items()} for layer in out.attentions[s]]
        steps.append(Step(int(tok), rows, logits[0, -1].float(), paged.length, paged.blocks_in_use))
        fed = torch.tensor([[tok]], dtype=torch.long, device=src.device)
    cross = 0
    if seq2seq:
        pairs = (paged.get_cross(i) for i in range(L) if paged.has_cross(i))
        cross = sum(k.nbytes + v.nbytes for k, v in pairs)
    spec = CacheSpec(L, hkv, hd, elem, str(first_k.dtype).replace("torch.", ""), total,
                     static.nbytes, block_size, paged.bytes_per_block, cross,
                     (first_k[0, :, 0].numel() + first_v[0, :, 0].numel()) * elem)
    return prefix, steps, spec


# -- positional encodings ----------------------------------------------------------------------------------
def position_encodings(ld: Loaded) -> list[dict[str, Any]]:
    """Each positional encoding the model holds: {"where", "kind", and its tensors}. The stacks' encodings
    through nn/position.py's classes, plus the family tables outside the hooks (ViT, Whisper)."""
    m = ld.model
    found: list[dict[str, Any]] = []
    if ld.kind == "image":
        c = config(ld)

        pos = m.encoder.position  # ViT's patch positions are the encoder's PatchGrid encoding
        table = pos.table((c.grid, c.grid)) if isinstance(pos, PatchGrid) else None
        n_extra = 1 if c.pooling == "cls" else 0
        if table is None:
            found.append({"where": "patches", "kind": "none"})
        else:
            found.append({"where": "patches", "kind": f"{c.patch_position} (2-D grid)",
                          "table": table[0, n_extra:].detach().float(), "grid": [c.grid, c.grid]})
    if ld.kind == "audio":
        found.append({"where": "encoder (audio frames)", "kind": "sinusoidal (fixed)",
                      "table": m.encoder.position.weight.detach().float()})  # a FixedTable
    for role, stack in stacks(ld).items():
        p = stack.position
        if ld.kind in ("image", "audio") and role == "encoder":
            continue  # their encoder positions are the family tables above
        where = role if len(stacks(ld)) > 1 else "tokens"
        if isinstance(p, Sinusoidal):
            found.append({"where": where, "kind": "sinusoidal", "table": p.table.detach().float()})
        elif isinstance(p, Learned):
            found.append({"where": where, "kind": "learned", "table": p.weight.detach().float()})
        elif isinstance(p, RoPE):
            # through the hook itself: rotate the same all-ones query/key to every position; q_m . k_0 as a
            # function of m is RoPE's dependence on distance alone
            n = POSITIONS_SHOWN
            ones = torch.ones(1, 1, n, p.head_dim, device=p.inv_freq.device)
            q, k = p.rotate(ones, ones, 0)
            found.append({"where": where, "kind": "rope", "head_dim": p.head_dim, "base": p.base,
                          "inv_freq": p.inv_freq.detach().double(),
                          "cos": p.cos[:n, : p.head_dim // 2].float(),
                          "dot_by_distance": (q[0, 0] @ k[0, 0, 0]).float() / p.head_dim})
        elif isinstance(p, ALiBi):
            n = 16
            found.append({"where": where, "kind": "alibi", "slopes": p.slopes.detach().float(),
                          "bias": p.bias(n, n, stack.causal)[0].float()})  # (H, n, n) from the hook
        else:
            found.append({"where": where, "kind": "none"})
    return found


# -- the built-in sample images ----------------------------------------------------------------------------
def sample_images(ld: Loaded) -> int:
    """How many built-in images the page offers (scikit-learn's bundled digits, or the run's held-out
    split)."""
    return 20


def image(ld: Loaded, index: int) -> tuple[Tensor, str]:
    """(1, C, H, W) pixels in the model's input range, and a caption. A run folder's own held-out images
    (its task knows the preprocessing); otherwise scikit-learn's bundled 8x8 digits, resized to the model's
    image size (offline, always at hand)."""
    c = config(ld)
    if not 0 <= index < sample_images(ld):
        raise ExploreError(f"image index {index} is out of range [0, {sample_images(ld)})")
    if ld.task is not None and hasattr(ld.task, "batch"):
        b = ld.task.batch(0, index + 1, "val")
        px, y = b["pixel_values"][index:index + 1], int(b["labels"][index])
        names = getattr(ld.task, "classes", None)
        return px.float(), f"held-out image {index} (class {names[y] if names else y})"
    imgs, labels, _ = load_digit_images()
    x = torch.from_numpy(imgs[index]).float()[None, None]  # (1, 1, 8, 8) in [0, 1]
    x = F.interpolate(x, size=(c.image_size, c.image_size), mode="bilinear", align_corners=False)
    x = _normalize(ld, x.repeat(1, c.n_channels, 1, 1))
    return x, f"scikit-learn digit {index} (a {int(labels[index])})"


def question_image(ld: Loaded, index: int) -> tuple[Any, str]:
    """A vision-language model's built-in image: scikit-learn's digit `index` as an RGB PIL image (the
    folder's own preprocessing resizes it)."""
    if not 0 <= index < sample_images(ld):
        raise ExploreError(f"image index {index} is out of range [0, {sample_images(ld)})")
    imgs, labels, _ = load_digit_images()
    grey = Image.fromarray(np.asarray(imgs[index] * 255, dtype=np.uint8)).resize((64, 64), Image.NEAREST)
    return grey.convert("RGB"), f"scikit-learn digit {index} (a {int(labels[index])})"


def _normalize(ld: Loaded, x: Tensor) -> Tensor:
    """A Hugging Face image folder's own normalisation (preprocessor_config.json), when it has one."""
    cfg = ld.folder / "preprocessor_config.json" if ld.folder is not None else None
    if cfg is None or not cfg.is_file():
        return x
    pre = json.loads(cfg.read_text(encoding="utf-8"))
    if not pre.get("do_normalize", True) or "image_mean" not in pre:
        return x
    mean = torch.tensor(pre["image_mean"], dtype=x.dtype).view(1, -1, 1, 1)
    std = torch.tensor(pre.get("image_std", [1.0] * len(pre["image_mean"])), dtype=x.dtype).view(1, -1, 1, 1)
    return (x - mean[:, : x.shape[1]]) / std[:, : x.shape[1]]
