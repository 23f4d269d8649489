"""Where a vision-language model (LLaVA) looks while it answers: the attention from its answer tokens to the
image's placeholder positions, averaged over heads (of one layer or of all), laid out on the patch grid and
drawn as a heat map over the image.

    qkv attention LLAVA_FOLDER --image cat.png --input "What is in the picture?" [--layer L] [--token K]

The prompt is `qkv chat --image`'s (qkv.chat_vision: the folder's chat template with the image, its image
token expanded to one placeholder per patch embedding); the answer is the greedy one. Answer token j is chosen
by the query at the position before it (the last prompt position for the first token), so the map of token j
is that query's row: the same row `qkv explore`'s generation view shows for a step. One full forward over the
prompt and the answer gives every row (the naive softmax: rows sum to 1 over all the positions a query sees).
The grid holds, per patch, the mean over the chosen layers, heads and answer tokens of the attention on that
patch's placeholder position; its sum is the share of the attention the image gets. With
vision_feature_select_strategy "full" the first placeholder is CLIP's class token: its share is reported
apart, the grid is the patches'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.chat_vision import VisionChatSession
from qkv.config import ConfigError
from qkv.experiments.attention import collect_attentions
from qkv.interop.llava import ImageProcessor, load_image
from qkv.interop.tokenizer import load_hf_tokenizer
from qkv.models.vit import draw_patch_overlays
from qkv.storage import atomic_write_text


@dataclass
class ImageAttention:
    grid: Tensor  # (gh, gw) float64: mean attention on each patch's position
    prompt_ids: list[int]
    answer_ids: list[int]
    image_positions: list[int]  # the placeholders' positions in the sequence, in patch order
    layers: list[int]  # the layers averaged
    tokens: list[int]  # the answer tokens (indices into answer_ids) averaged
    class_share: float | None = None  # "full" feature selection: the class token's mean attention
    pixel_values: Tensor | None = None  # (1, C, H, W): the image as the tower saw it
    # (1, H, T, T) per layer over the prompt and the answer: every row, for views beyond the grid
    attentions: list[Tensor] = field(default_factory=list, repr=False)

    @property
    def image_share(self) -> float:
        """The share of the chosen rows' attention that lands on the image (patches and class token)."""
        return float(self.grid.sum()) + (self.class_share or 0.0)

    def query_rows(self) -> list[int]:
        """The positions whose queries chose the answer tokens (the position before each)."""
        return [len(self.prompt_ids) - 1 + j for j in range(len(self.answer_ids))]


def image_prompt(model: Any, tokenizer: Any, processor: Any, question: str,
                 image: Any) -> tuple[list[int], Tensor]:
    """(prompt ids with the placeholders, pixel_values) exactly as `qkv chat --image` builds them."""
    session = VisionChatSession(model, tokenizer, processor=processor)
    session.set_image(image)
    return session._render([{"role": "user", "content": question}]), session.pixel_values


def choose_layers(n_layers: int, layer: int | None) -> list[int]:
    """--layer L (negative from the end) -> [L]; None -> every layer."""
    if layer is None:
        return list(range(n_layers))
    if not -n_layers <= layer < n_layers:
        raise ConfigError(f"--layer {layer}: the language model has {n_layers} layers (0..{n_layers - 1}, "
                          f"or -1..-{n_layers} from the end)")
    return [layer % n_layers]


def patch_map(attentions: list[Tensor], rows: list[int], image_positions: list[int], layers: list[int],
              grid: tuple[int, int], class_token: bool = False) -> tuple[Tensor, float | None]:
    """(gh, gw) float64: the attention of the query `rows` on the `image_positions` keys, averaged over the
    chosen layers, every head and the rows; attentions: (1, H, T, T) per layer. class_token: the first image
    position is the vision tower's class token (returned apart as its mean share)."""
    w = torch.stack([attentions[i][0].double() for i in layers])  # (L', H, T, T)
    keys = w[:, :, rows][..., image_positions].mean(dim=(0, 1, 2))  # (n_image_positions,)
    cls = float(keys[0]) if class_token else None
    return keys[int(class_token):].reshape(grid), cls


@torch.no_grad()
def image_attention(model: Any, tokenizer: Any, processor: Any, question: str, image: Any, *,
                    layer: int | None = None, token: int | None = None,
                    max_new_tokens: int = 16) -> ImageAttention:
    """The map for a question about an image: the greedy answer (at most max_new_tokens), then the attention
    of its tokens (or of answer token `token` alone) to the image's patches."""
    c = model.config
    if not question.strip():
        raise ConfigError("--input: the question is empty")
    ids, pixels = image_prompt(model, tokenizer, processor, question, image)
    prompt = torch.tensor([ids])
    out = model.generate(prompt, max_new_tokens, pixel_values=pixels, do_sample=False, num_beams=1)
    answer = [int(i) for i in out[0, len(ids):].tolist()]
    if not answer:
        raise ConfigError("the model generated no token to draw the attention of")
    tokens = list(range(len(answer)))
    if token is not None:
        if not -len(answer) <= token < len(answer):
            raise ConfigError(f"--token {token}: the answer has {len(answer)} token(s) "
                              f"(0..{len(answer) - 1})")
        tokens = [token % len(answer)]
    layers = choose_layers(c.text.n_layers, layer)
    batch = {"input_ids": torch.tensor([ids + answer]), "pixel_values": pixels}
    maps = collect_attentions(model, batch)["self"]
    positions = [i for i, t in enumerate(ids) if t == c.image_token_id]
    side = c.vision.image_size // c.vision.patch_size
    full = c.feature_select == "full"
    result = ImageAttention(torch.zeros(side, side), ids, answer, positions, layers, tokens,
                            pixel_values=pixels, attentions=maps)
    rows = [result.query_rows()[j] for j in tokens]
    result.grid, result.class_share = patch_map(maps, rows, positions, layers, (side, side), full)
    return result


def display_image(processor: Any, pixel_values: Tensor) -> Tensor:
    """(H, W, 3) in [0, 1]: what the tower sees (resized, cropped), its normalisation undone."""
    x = pixel_values[0].double()
    if processor.mean is not None and processor.std is not None:
        x = x * torch.tensor(processor.std).view(-1, 1, 1) + torch.tensor(processor.mean).view(-1, 1, 1)
    if processor.rescale_factor is None:
        x = x / 255.0
    return x.clamp(0, 1).permute(1, 2, 0).float()


def vlm_attention_report(model: Any, folder: Path, question: str, image_file: str, out_png: Path, *,
                         layer: int | None = None, token: int | None = None) -> list[str]:
    """`qkv attention LLAVA --image FILE --input QUESTION`: the overlay PNG and <stem>_image.json (the grid,
    the answer, what was averaged); returns the lines printed."""
    try:
        picture = load_image(image_file)
    except ValueError as e:
        raise ConfigError(f"--image {e}") from None
    tok, processor = load_hf_tokenizer(folder), ImageProcessor.from_folder(folder)
    res = image_attention(model, tok, processor, question, picture, layer=layer, token=token)
    answer = tok.decode(res.answer_ids)
    which = "all layers" if layer is None else f"layer {res.layers[0]}"
    whose = "every answer token" if token is None else f"answer token {res.tokens[0]}"
    out_png.parent.mkdir(parents=True, exist_ok=True)
    shown = answer if len(answer) <= 40 else answer[:39] + "…"
    draw_patch_overlays([display_image(processor, res.pixel_values)], [res.grid], str(out_png),
                        [f"answer: {shown}"],
                        f"attention of {whose}\non the image ({which}, mean over heads)",
                        panel=4.0)
    js = out_png.with_name(f"{out_png.stem}_image.json")
    atomic_write_text(json.dumps({"question": question, "answer": answer, "answer_ids": res.answer_ids,
                                  "layers": res.layers, "tokens": res.tokens, "image_share": res.image_share,
                                  "class_share": res.class_share, "grid": res.grid.tolist()}, indent=1), js)
    return [f"wrote {out_png}", f"wrote {js}", f"answer: {answer}",
            f"share of the attention on the image ({whose}, {which}): {res.image_share:.3f}"]
