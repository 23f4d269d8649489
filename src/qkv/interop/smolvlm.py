"""Hugging Face `idefics3` / `smolvlm` folders (Idefics3ForConditionalGeneration,
SmolVLMForConditionalGeneration: a SigLIP vision encoder, a pixel-shuffle connector and a Llama decoder) ->
qkv's LLaVA (models/vlm.py), and the folder's preprocessing (image tiles and the prompt's image tokens).

The two model types compute the same thing for images (SmolVLM's modeling file is Idefics3's with another
name; its processor adds video): one loader serves both. Keys: "model.vision_model." -> "vision.",
"model.connector.modality_projection." -> "projector.", "model.text_model." -> "model." (the decoder, loaded
by the Llama loader), "lm_head." as it is.

The tower is SigLIP's: a patch convolution with bias, learned positions, no class token, no norm before the
blocks, Pre-LN blocks with tanh-GELU, and `post_layernorm` on every patch of the last block's output (all
layers run). Idefics3's NaViT position lookup maps patch i of a full tile to row bucketize(i / side) of the
table, which float rounding makes differ from i for some grid sides (19, 25, ...): the loader stores the rows
it reads, in patch order, so the tower adds them as it adds CLIP's.

Preprocessing (`Idefics3Processor.from_folder`) is Idefics3ImageProcessor's with PIL (its default backend
without torchvision): RGB, resize so the longest edge is `size` (even short edge), then either tiles (each
side rounded up to a multiple of the tile, cut into rows x cols tiles, plus the whole image resized to one
tile: the "global image") or, with do_image_splitting false, the image resized to one square tile; rescale and
normalise. Each <image> of the prompt becomes, as Idefics3Processor / SmolVLMProcessor write it:
  per tile row: (<fake_token_around_image><row_r_col_c><image> * image_seq_len) per column, then "\\n";
  then "\\n<fake_token_around_image><global-img><image> * image_seq_len<fake_token_around_image>"
(one image without tiles: only the last part, without the newline). `expand_ids` replaces each <image> id of
a tokenized prompt by the ids of that text: it begins and ends with added special tokens, at which the
tokenizer splits before anything else, so it tokenizes alone as it does inside the prompt (tested against
Idefics3Processor, which expands the text and then tokenizes).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from qkv.interop.classifier import HF_ACTIVATIONS
from qkv.interop.clip import encoder_layer_map
from qkv.interop.common import HFTensors, build_skeleton, check_sizes, export_state, load_hf_weights, require
from qkv.interop.llama import check_decoder_sizes, key_map, load_decoder
from qkv.interop.llama import config_from_hf as llama_config_from_hf
from qkv.interop.llava import LLAMA_DEFAULTS, ImageProcessor, canonical_key, canonical_tensors, sub_config
from qkv.interop.registry import ExportRequest, ModelType, register
from qkv.interop.vit import hf_activation
from qkv.interop.vlm_export import language_state, source_tensors, write_vlm_folder
from qkv.models.vlm import LLaVA, VisionConfig, VLMConfig
from qkv.storage import CheckpointError, read_json_object, unwrap

# transformers' defaults for the fields a folder's config.json may leave out (Idefics3VisionConfig,
# Idefics3Config, whose text_config is a Llama with rms_norm_eps 1e-5)
VISION_DEFAULTS = {"hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12,
                   "num_attention_heads": 16, "num_channels": 3, "image_size": 224, "patch_size": 32,
                   "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}
TEXT_DEFAULTS = {**LLAMA_DEFAULTS, "rms_norm_eps": 1e-5}
IDEFICS3_DEFAULTS = {"image_token_id": 128257, "scale_factor": 2, "tie_word_embeddings": False}
MODEL_TYPES = ("idefics3", "smolvlm")
VISION_TYPES = (None, "idefics3_vision", "smolvlm_vision", "idefics3", "smolvlm")

RENAMES = (("model.vision_model.", "vision."), ("model.connector.modality_projection.", "projector."),
           ("model.text_model.", "model."))


def config_from_hf(meta: dict[str, Any]) -> VLMConfig:
    """An idefics3 / smolvlm config.json -> VLMConfig (transformers' defaults for fields it leaves out)."""
    m = {**IDEFICS3_DEFAULTS, **meta}
    v = sub_config(meta, "vision_config", VISION_DEFAULTS)
    require(v.get("model_type") in VISION_TYPES,
            f"vision_config model_type {v.get('model_type')!r} is not supported (Idefics3's SigLIP tower)")
    # the top level's tie_word_embeddings is the one transformers reads (the decoder is a sub-module)
    text = {**sub_config(meta, "text_config", TEXT_DEFAULTS),
            "tie_word_embeddings": m["tie_word_embeddings"]}
    vision = VisionConfig(
        image_size=int(v["image_size"]), patch_size=int(v["patch_size"]), n_channels=int(v["num_channels"]),
        n_layers=int(v["num_hidden_layers"]), d_model=int(v["hidden_size"]),
        n_heads=int(v["num_attention_heads"]), d_ff=int(v["intermediate_size"]),
        ffn=hf_activation(v["hidden_act"]), norm_eps=float(v["layer_norm_eps"]), placement="pre",
        position="none", class_token=False, pre_norm=False, patch_bias=True, post_norm=True,
        attn_dropout=float(v.get("attention_dropout", 0.0)))
    return VLMConfig(vision=vision, text=llama_config_from_hf(text), image_token_id=int(m["image_token_id"]),
                     feature_select="full", projector="pixel_shuffle", projector_bias=False,
                     scale_factor=int(m["scale_factor"]))


def navit_position_ids(side: int) -> Tensor:
    """The position-table rows Idefics3VisionEmbeddings reads for a full tile of side x side patches."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    coords = torch.arange(side, dtype=torch.float32) * (1.0 / torch.tensor(side, dtype=torch.float32))
    bucket = torch.bucketize(coords.clamp(max=1.0 - 1e-6), boundaries, right=True)
    return (bucket[:, None] * side + bucket[None, :]).reshape(-1)


def vision_key_map(n_layers: int) -> dict[str, str]:
    """HF SigLIP tower + connector keys (renamed by canonical_key) -> ours; q, k and v fuse into qkv_proj."""
    e = "vision.embeddings."
    m = {f"{e}position_embedding.weight": "vision.pos_emb",
         f"{e}patch_embedding.weight": "vision.patch.weight", f"{e}patch_embedding.bias": "vision.patch.bias",
         "projector.proj.weight": "projector.proj.weight",
         "vision.post_layernorm.weight": "vision.encoder.final_norm.weight",
         "vision.post_layernorm.bias": "vision.encoder.final_norm.bias"}
    return m | encoder_layer_map("vision.", "vision.encoder.", n_layers)


def _check_vision_sizes(sd: HFTensors, config: VLMConfig) -> None:
    v, e, s = config.vision, "vision.embeddings.", config.scale_factor
    check_sizes(sd, sd.source, [
        ("vision_config.num_hidden_layers", v.n_layers, "vision.encoder.layers.{}.layer_norm1.weight", None),
        ("vision_config.hidden_size", v.d_model, f"{e}patch_embedding.weight", 0),
        ("vision_config.num_channels", v.n_channels, f"{e}patch_embedding.weight", 1),
        ("vision_config.patch_size", v.patch_size, f"{e}patch_embedding.weight", 2),
        ("(image_size / patch_size)**2", v.n_positions, f"{e}position_embedding.weight", 0),
        ("vision_config.intermediate_size", v.d_ff, "vision.encoder.layers.0.mlp.fc1.weight", 0),
        ("vision_config.hidden_size * scale_factor**2", v.d_model * s * s, "projector.proj.weight", 1),
        ("text_config.hidden_size", config.text.d_model, "projector.proj.weight", 0)])


def load_idefics3(folder: Path, meta: dict[str, Any]) -> LLaVA:
    """An Idefics3 / SmolVLM ForConditionalGeneration folder -> our LLaVA in eval mode, in its dtype."""
    config = config_from_hf(meta)
    sd = canonical_tensors(folder, ("vision.", "projector."), RENAMES)
    require(sd, f"{sd.source}: no vision tower or connector keys (is this an idefics3 / smolvlm folder?)")
    _check_vision_sizes(sd, config)
    text = canonical_tensors(folder, ("model.", "lm_head."), RENAMES)
    check_decoder_sizes(text, config.text)  # before the key map is expanded per layer
    text_meta = {**sub_config(meta, "text_config", TEXT_DEFAULTS),
                 "tie_word_embeddings": config.text.tie_embeddings}
    decoder = load_decoder(folder, text_meta, config.text, key_map(config.text), text)
    sd.pop("vision.embeddings.position_ids", None)

    model = build_skeleton(lambda: LLaVA(config, language_model=decoder))
    parts = nn.Module()  # what the file fills: the tower and the connector (the decoder is loaded)
    parts.vision, parts.projector = model.vision, model.projector
    rows = navit_position_ids(config.vision.image_size // config.vision.patch_size)
    transforms = {"vision.embeddings.position_embedding.weight": lambda t: t[rows].unsqueeze(0)}
    mapping = vision_key_map(config.vision.n_layers)
    load_hf_weights(parts, sd, mapping, transforms=transforms, source=sd.source)
    parts.to(decoder.lm_head.weight.dtype)  # one dtype for the model, as transformers loads it
    # the token ids are the text config's: Idefics3Config's top-level pad_token_id (128002 by default) is a
    # deprecated field that transformers itself says may not be the pad token (it can lie past the vocabulary)
    model.folder_generation_config = dict(decoder.folder_generation_config)
    return model.eval()


# -- export -----------------------------------------------------------------------------------------
IDEFICS3_PREFIXES = {"vision.": "model.vision_model.", "projector.": "model.connector.modality_projection."}
ARCHITECTURES = {"idefics3": "Idefics3ForConditionalGeneration", "smolvlm": "SmolVLMForConditionalGeneration"}


def idefics3_config_to_hf(config: Any, text_config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The inverse of smolvlm.config_from_hf, for a VLMConfig of Idefics3's shape (refused otherwise)."""
    require(model_type in ARCHITECTURES, f"cannot export to model_type {model_type!r}; choose one of "
                                         f"{sorted(ARCHITECTURES)}")
    v = config.vision
    siglip = (not v.class_token and not v.pre_norm and v.patch_bias and v.post_norm and v.placement == "pre"
              and v.ffn in HF_ACTIVATIONS and config.vision_blocks == v.n_layers)
    require(siglip and config.projector == "pixel_shuffle" and config.feature_select == "full",
            f"only Idefics3-shaped models (a SigLIP tower read at its last layer, a pixel-shuffle connector) "
            f"can be exported as {model_type}")
    vision = {"model_type": f"{model_type}_vision", "hidden_size": v.d_model, "intermediate_size": v.d_ff,
              "num_hidden_layers": v.n_layers, "num_attention_heads": v.n_heads, "num_channels": v.n_channels,
              "image_size": v.image_size, "patch_size": v.patch_size, "hidden_act": HF_ACTIVATIONS[v.ffn],
              "layer_norm_eps": v.norm_eps, "attention_dropout": v.attn_dropout}
    return {"model_type": model_type, "architectures": [ARCHITECTURES[model_type]],
            "vision_config": vision, "text_config": text_config, "scale_factor": config.scale_factor,
            "image_token_id": config.image_token_id, "tie_word_embeddings": config.text.tie_embeddings}


def _position_table(pos: Tensor, side: int, source_table: Tensor | None) -> Tensor:
    """The model's positions (1, side**2, d), in patch order -> Idefics3's table (side**2, d)."""
    pos = pos.detach()[0]
    table = source_table.to(pos.dtype).clone() if source_table is not None else torch.zeros_like(pos)
    table[navit_position_ids(side)] = pos
    return table


def export_idefics3(model: LLaVA, out: str | os.PathLike, *, model_type: str = "idefics3",
                    source: str | os.PathLike | None = None) -> Path:
    """OUT as a Hugging Face idefics3 / smolvlm folder (config.json and model.safetensors, in the model's
    dtype) that transformers loads as Idefics3- / SmolVLMForConditionalGeneration; `source` (the folder it
    was loaded from) gives the processor, tokenizer and chat template files and any position row the model
    never reads. The tower runs every layer: it is written from the model itself, config.json from the model's
    config. Its position table holds the rows Idefics3's bucketed lookup reads, in patch order; for some grid
    sides (19, 25, ...) that lookup reads a row twice and another never, and such a row is taken from `source`
    when one is given (zeros otherwise: transformers reads it for no full tile)."""
    model = unwrap(model)
    config = model.config
    state, text_config = language_state(model.language_model, "model.text_model.")
    hf_config = idefics3_config_to_hf(config, text_config, model_type)
    pos_key = "vision.embeddings.position_embedding.weight"
    source_table = (source_tensors(Path(source), lambda k: canonical_key(k, RENAMES), pos_key).get(pos_key)
                    if source else None)
    side = config.vision.image_size // config.vision.patch_size
    ours = {"vision." + k: t for k, t in model.vision.state_dict().items()}
    ours.update({"projector." + k: t for k, t in model.projector.state_dict().items()})
    parts = export_state(ours, vision_key_map(config.vision.n_layers),
                         transforms={pos_key: lambda t: _position_table(t, side, source_table)})
    for k, t in parts.items():
        head = next(p for p in IDEFICS3_PREFIXES if k.startswith(p))
        state[IDEFICS3_PREFIXES[head] + k[len(head):]] = t
    return write_vlm_folder(out, state, hf_config, source)


def write_idefics3(model: LLaVA, out: Path, request: ExportRequest) -> None:
    export_idefics3(model, out, model_type=request.model_type, source=request.source)


register(*(ModelType(mt, "decoder", "llava", load_idefics3, write_idefics3) for mt in MODEL_TYPES))


# -- the processor: an image -> tiles -> pixel_values, <image> -> the tiles' tokens -----------------------
PROCESSOR_TYPES = tuple(f"{m}ImageProcessor{b}" for m in ("Idefics3", "SmolVLM") for b in ("", "Fast", "Pil"))
MAX_IMAGE_SIZE = 4096  # Idefics3ImageProcessor's cap on a side after the first resize


def _longest_edge(value: Any, what: str) -> int:
    if isinstance(value, dict) and set(value) == {"longest_edge"}:
        return int(value["longest_edge"])
    raise CheckpointError(f"processor config: {what} {value!r} is not supported ({{'longest_edge': n}} only)")


def _longest_edge_size(h: int, w: int, edge: int) -> tuple[int, int]:
    """Idefics3's first resize: the longest side to `edge`, the other in proportion (rounded down, then up
    to an even number)."""
    aspect = w / h
    if w >= h:
        w, h = edge, int(edge / aspect)
        h += h % 2
    else:
        h, w = edge, int(edge * aspect)
        w += w % 2
    h, w = max(h, 1), max(w, 1)
    aspect = w / h  # transformers' upper bound (a no-op below 4096 px), on the resized sides
    if w >= h and w > MAX_IMAGE_SIZE:
        w, h = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif h > w and h > MAX_IMAGE_SIZE:
        h, w = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(h, 1), max(w, 1)


def _tile_multiple_size(h: int, w: int, tile: int) -> tuple[int, int]:
    """Idefics3's resize_for_vision_encoder: both sides up to a multiple of the tile."""
    aspect = w / h
    if w >= h:
        w = math.ceil(w / tile) * tile
        h = math.ceil(int(w / aspect) / tile) * tile
    else:
        h = math.ceil(h / tile) * tile
        w = math.ceil(int(h * aspect) / tile) * tile
    return h, w


def _to_tensor(image: Any, rescale: float | None, mean: Sequence[float] | None,
               std: Sequence[float] | None) -> Tensor:
    """A PIL image -> (C, H, W) float32, rescaled and normalised as transformers' numpy steps do."""
    x = torch.from_numpy(np.asarray(image).copy())
    x = (x.unsqueeze(-1) if x.dim() == 2 else x).permute(2, 0, 1)
    x = (x.double() * rescale if rescale is not None else x.double()).float()
    if mean is not None and std is not None:
        x = (x - torch.tensor(mean).view(-1, 1, 1)) / torch.tensor(std).view(-1, 1, 1)
    return x


@dataclass
class Idefics3Processor:
    """Idefics3ImageProcessor's tiling with PIL and torch, and Idefics3Processor's image-token expansion."""

    tile: int = 364  # max_image_size: a tile's side (the vision tower's image_size)
    longest_edge: int | None = 4 * 364  # size: the first resize's longest side (None: no first resize)
    split: bool = True  # do_image_splitting
    resample: int = 1  # PIL's code: 1 = Lanczos
    rescale_factor: float | None = 1 / 255
    mean: tuple[float, ...] | None = (0.5, 0.5, 0.5)
    std: tuple[float, ...] | None = (0.5, 0.5, 0.5)
    convert_rgb: bool = True
    image_seq_len: int = 169  # <image> tokens per tile (the model's image_tokens)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Idefics3Processor:
        """preprocessor_config.json (or processor_config.json's "image_processor", as transformers 5 saves it)
        and processor_config.json's image_seq_len."""
        folder = Path(folder)
        both = read_json_object(folder / "processor_config.json")
        if (pre := folder / "preprocessor_config.json").is_file():
            p, where = read_json_object(pre), pre
        else:
            p, where = both.get("image_processor"), folder / "processor_config.json"
            require(isinstance(p, dict), f"{folder}: no preprocessor_config.json and no image_processor in "
                                         "processor_config.json (the image preprocessing of the folder)")
        kind = p.get("image_processor_type")
        require(kind in PROCESSOR_TYPES, f"{where}: image_processor_type {kind!r} is not supported "
                                         f"({', '.join(PROCESSOR_TYPES[:2])}, ...)")

        def on(flag: str) -> bool:  # Idefics3ImageProcessor's steps are all on by default
            return bool(p.get(flag, True))

        normalize = on("do_normalize")
        return cls(tile=_longest_edge(p.get("max_image_size", {"longest_edge": 364}), "max_image_size"),
                   longest_edge=_longest_edge(p.get("size", {"longest_edge": 4 * 364}), "size")
                   if on("do_resize") else None,
                   split=on("do_image_splitting"), resample=int(p.get("resample", 1)),
                   rescale_factor=float(p.get("rescale_factor", 1 / 255)) if on("do_rescale") else None,
                   mean=tuple(p.get("image_mean", cls.mean)) if normalize else None,
                   std=tuple(p.get("image_std", cls.std)) if normalize else None,
                   convert_rgb=on("do_convert_rgb"), image_seq_len=int(both.get("image_seq_len", 169)))

    def _sizes(self, w: int, h: int) -> tuple[tuple[int, int] | None, tuple[int, int]]:
        """The first resize's (h, w) (None: none) and the size the tiles are cut from."""
        first = _longest_edge_size(h, w, self.longest_edge) if self.longest_edge is not None else None
        h, w = first or (h, w)
        return first, _tile_multiple_size(h, w, self.tile) if self.split else (self.tile, self.tile)

    def _grid(self, h: int, w: int) -> tuple[int, int]:
        t = self.tile
        return (h // t, w // t) if self.split and (h > t or w > t) else (0, 0)

    def grid(self, image: Any) -> tuple[int, int]:
        """(rows, cols) of tiles for an image; (0, 0): the image is one tile (no global image added)."""
        return self._grid(*self._sizes(*image.size)[1])

    def _frames(self, image: Any) -> list[Any]:
        if self.convert_rgb:
            image = image.convert("RGB")
        first, (h, w) = self._sizes(*image.size)
        if first is not None:
            image = image.resize(first[::-1], resample=self.resample)
        image = image.resize((w, h), resample=self.resample)
        rows, cols = self._grid(h, w)
        if rows == cols == 0:
            return [image]
        t = self.tile
        tiles = [image.crop((c * t, r * t, (c + 1) * t, (r + 1) * t))
                 for r in range(rows) for c in range(cols)]
        return [*tiles, image.resize((t, t), resample=self.resample)]  # the global image last

    def __call__(self, images: Any) -> Tensor:
        """A PIL image or a list of them -> pixel_values (n_tiles, C, tile, tile) float32: each image's tiles
        row by row, then its global image."""
        out = []
        for image in images if isinstance(images, (list, tuple)) else [images]:
            out += [_to_tensor(f, self.rescale_factor, self.mean, self.std) for f in self._frames(image)]
        return torch.stack(out)

    def image_text(self, rows: int, cols: int) -> str:
        """What Idefics3Processor / SmolVLMProcessor write in place of one <image> of rows x cols tiles."""
        fake, image = "<fake_token_around_image>", "<image>" * self.image_seq_len
        tiles = "".join("".join(f"{fake}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n"
                        for r in range(rows))
        whole = f"{fake}<global-img>{image}{fake}"
        return f"{tiles}\n{whole}" if rows or cols else whole

    def expand_ids(self, ids: Sequence[int], image_token_id: int, grids: Sequence[tuple[int, int]],
                   tokenizer: Any) -> list[int]:
        """Each image token of `ids` -> the ids of its image's text (grids: one (rows, cols) per image, in
        order). The text begins and ends with added special tokens, so its ids are the same alone as within
        the prompt (the tokenizer splits at added tokens before anything else)."""
        out: list[int] = []
        images = iter(grids)
        for i in ids:
            if i != image_token_id:
                out.append(i)
                continue
            grid = next(images, None)
            if grid is None:
                raise ValueError(f"the prompt holds more image tokens than the {len(grids)} image(s) given")
            out.extend(self.image_ids(grid, tokenizer))
        return out

    def image_ids(self, grid: tuple[int, int], tokenizer: Any) -> list[int]:
        """The ids of one image's text (grid: its (rows, cols) of tiles): what replaces its image token, the
        one place serving, `qkv chat --image` and fine-tuning build them."""
        return list(tokenizer.encode(self.image_text(*grid), add_special_tokens=False))


def folder_processor(folder: str | Path) -> Any:
    """The image preprocessing of a vision-language folder: an Idefics3Processor for idefics3 / smolvlm
    folders, else llava's ImageProcessor."""
    try:
        mt = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        mt = None
    if mt in MODEL_TYPES:
        return Idefics3Processor.from_folder(folder)
    return ImageProcessor.from_folder(folder)
