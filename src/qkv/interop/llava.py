"""Hugging Face `llava` folders (LlavaForConditionalGeneration: a CLIP vision tower, a 2-layer projector and a
Llama-style decoder) -> qkv's LLaVA (models/vlm.py), and the folder's image preprocessing.

Three key layouts exist: transformers 4.x ("language_model.model.", "language_model.lm_head.",
"vision_tower.vision_model.", "multi_modal_projector."), 5.x ("model.language_model.", "lm_head.",
"model.vision_tower.", "model.multi_modal_projector.") and the 5.x save of a 4.x-style model (the vision tower
without "vision_model."). All are renamed to one ("model." / "lm_head." for the decoder, "vision." and
"projector.") before the key maps read them; the decoder is then loaded by the Llama loader
(interop/llama.py).

A folder's config.json holds only the sub-config fields that differ from transformers' defaults (llava-hf's
text_config has no hidden_size: a 7B Llama's 4096), so those defaults are filled in first; every size is then
checked against the tensors' shapes before anything is built.

Preprocessing (`ImageProcessor`, from preprocessor_config.json) is CLIPImageProcessor's: RGB, resize so the
shortest edge is `size` (PIL, bicubic by default), center crop, rescale by 1/255, normalise by the folder's
mean and std. The prompt's one <image> token per image becomes `image_tokens` placeholders
(`expand_image_tokens`), as LlavaProcessor does.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from qkv.image_io import open_image
from qkv.interop.clip import encoder_layer_map
from qkv.interop.common import HFTensors, build_skeleton, check_sizes, load_hf_weights, require
from qkv.interop.llama import check_decoder_sizes, key_map, load_decoder
from qkv.interop.llama import config_from_hf as llama_config_from_hf
from qkv.interop.registry import ExportRequest, ModelType, register
from qkv.interop.vit import hf_activation
from qkv.interop.vlm_export import language_state, source_tensors, write_vlm_folder
from qkv.models.vlm import LLaVA, VisionConfig, VLMConfig
from qkv.storage import CheckpointError, read_config, unwrap

# transformers' defaults for the fields a folder's config.json may leave out (LlamaConfig, CLIPVisionConfig,
# LlavaConfig)
LLAMA_DEFAULTS = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_act": "silu",
                  "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2}
CLIP_DEFAULTS = {"model_type": "clip_vision_model", "hidden_size": 768, "intermediate_size": 3072,
                 "num_hidden_layers": 12, "num_attention_heads": 12, "num_channels": 3, "image_size": 224,
                 "patch_size": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}
LLAVA_DEFAULTS = {
    "image_token_index": 32000,
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "projector_hidden_act": "gelu",
    "multimodal_projector_bias": True,
}

# (old prefix, new prefix), the first match wins
RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
           ("language_model.lm_head.", "lm_head."), ("language_model.", "model."),
           ("model.vision_tower.vision_model.", "vision."), ("model.vision_tower.", "vision."),
           ("vision_tower.vision_model.", "vision."), ("vision_tower.", "vision."),
           ("model.multi_modal_projector.", "projector."), ("multi_modal_projector.", "projector."))

IMAGE_TOKEN = "<image>"


def canonical_key(key: str, renames: Sequence[tuple[str, str]] = RENAMES) -> str:
    """`key` with the first (old prefix, new prefix) of `renames` it starts with replaced."""
    for old, new in renames:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def sub_config(meta: dict[str, Any], name: str, defaults: dict[str, Any]) -> dict[str, Any]:
    sub = meta.get(name) or {}
    require(isinstance(sub, dict), f"config.json: {name} must be a mapping, got {type(sub).__name__}")
    return {**defaults, **{k: v for k, v in sub.items() if v is not None or k not in defaults}}


def feature_layer_index(layer: Any, n_layers: int) -> int:
    """LLaVA's vision_feature_layer (an index into the tower's n_layers + 1 hidden states, the embeddings
    first; negative from the end) -> the number of blocks to run."""
    require(isinstance(layer, int) and not isinstance(layer, bool),
            f"vision_feature_layer {layer!r} is not supported (one layer index; lists of layers are not)")
    index = layer if layer >= 0 else n_layers + 1 + layer
    require(0 <= index <= n_layers, f"vision_feature_layer {layer} is out of range for a vision tower of "
                                    f"{n_layers} layers")
    return index


def vision_config_from_hf(v: dict[str, Any], n_layers: int, patch_bias: bool) -> VisionConfig:
    mt = v.get("model_type")
    require(
        mt == "clip_vision_model",
        f"vision_config model_type {mt!r} is not supported (CLIP vision towers only)",
    )
    act = v.get("hidden_act", "quick_gelu")
    return VisionConfig(
        image_size=int(v["image_size"]), patch_size=int(v["patch_size"]), n_channels=int(v["num_channels"]),
        n_layers=n_layers, d_model=int(v["hidden_size"]), n_heads=int(v["num_attention_heads"]),
        d_ff=int(v["intermediate_size"]), ffn="quick_gelu" if act == "quick_gelu" else hf_activation(act),
        norm_eps=float(v.get("layer_norm_eps", 1e-5)), placement="pre", position="none", class_token=True,
        pre_norm=True, patch_bias=patch_bias, attn_dropout=float(v.get("attention_dropout", 0.0)))


def config_from_hf(
    meta: dict[str, Any], patch_bias: bool = False, linear_projector: bool = False
) -> VLMConfig:
    """A llava config.json -> VLMConfig (transformers' defaults for the fields it leaves out)."""
    m = {**LLAVA_DEFAULTS, **meta}
    vision = sub_config(meta, "vision_config", CLIP_DEFAULTS)
    text = sub_config(meta, "text_config", LLAMA_DEFAULTS)
    n_used = feature_layer_index(m["vision_feature_layer"], int(vision["num_hidden_layers"]))
    select = m["vision_feature_select_strategy"]
    require(select in ("default", "full"), f"vision_feature_select_strategy {select!r} is not supported")
    token = m.get("image_token_id", m["image_token_index"])
    return VLMConfig(
        vision=vision_config_from_hf(vision, n_used, patch_bias),
        text=llama_config_from_hf(text),
        image_token_id=int(token),
        feature_select=select,
        projector="linear" if linear_projector else "mlp",
        projector_act=hf_activation(m["projector_hidden_act"]),
        projector_bias=bool(m["multimodal_projector_bias"]),
    )


def vision_key_map(
    n_layers: int, patch_bias: bool, linear_projector: bool, projector_bias: bool
) -> dict[str, str]:
    """HF CLIP vision tower + projector keys (renamed by canonical_key) -> ours, for the first n_layers
    blocks. q, k and v map to one fused qkv_proj (concatenated in that order)."""
    e = "vision.embeddings."
    m = {f"{e}class_embedding": "vision.cls_emb", f"{e}position_embedding.weight": "vision.pos_emb",
         f"{e}patch_embedding.weight": "vision.patch.weight",
         "vision.pre_layrnorm.weight": "vision.encoder.embed_norm.weight",
         "vision.pre_layrnorm.bias": "vision.encoder.embed_norm.bias"}
    if patch_bias:
        m[f"{e}patch_embedding.bias"] = "vision.patch.bias"
    m.update(encoder_layer_map("vision.", "vision.encoder.", n_layers))
    for i in (1,) if linear_projector else (1, 2):
        for kind in ("weight", "bias") if projector_bias else ("weight",):
            m[f"projector.linear_{i}.{kind}"] = f"projector.linear_{i}.{kind}"
    return m


def _check_vision_sizes(sd: HFTensors, vision: dict[str, Any], config: VLMConfig) -> None:
    v, e = config.vision, "vision.embeddings."
    check_sizes(sd, sd.source, [
        ("vision_config.num_hidden_layers", int(vision["num_hidden_layers"]),
         "vision.encoder.layers.{}.layer_norm1.weight", None),
        ("vision_config.hidden_size", v.d_model, f"{e}patch_embedding.weight", 0),
        ("vision_config.num_channels", v.n_channels, f"{e}patch_embedding.weight", 1),
        ("vision_config.patch_size", v.patch_size, f"{e}patch_embedding.weight", 2),
        ("(image_size / patch_size)**2 + 1", v.n_positions, f"{e}position_embedding.weight", 0),
        ("vision_config.intermediate_size", v.d_ff, "vision.encoder.layers.0.mlp.fc1.weight", 0),
        ("text_config.hidden_size", config.text.d_model, "projector.linear_1.weight", 0)])


def canonical_tensors(folder: Path, keep: tuple[str, ...],
                      renames: Sequence[tuple[str, str]] = RENAMES) -> HFTensors:
    """The folder's tensors under canonical names, only those starting with one of `keep` (nothing is
    read)."""
    sd = HFTensors(folder)
    sd.rename(lambda key: canonical_key(key, renames))
    for k in [k for k in sd if not k.startswith(keep)]:
        del sd[k]
    return sd


def load_llava(folder: Path, meta: dict[str, Any]) -> LLaVA:
    """A LlavaForConditionalGeneration folder -> our LLaVA in eval mode, in the folder's dtype."""
    sd = canonical_tensors(folder, ("vision.", "projector."))
    require(sd, f"{sd.source}: no vision tower or projector keys (is this a llava folder?)")
    patch_bias = "vision.embeddings.patch_embedding.bias" in sd
    linear = "projector.linear_1.weight" in sd and "projector.linear_2.weight" not in sd
    config = config_from_hf(meta, patch_bias, linear)
    _check_vision_sizes(sd, sub_config(meta, "vision_config", CLIP_DEFAULTS), config)
    text_meta = sub_config(meta, "text_config", LLAMA_DEFAULTS)
    text = canonical_tensors(folder, ("model.", "lm_head."))
    check_decoder_sizes(text, config.text)  # before the key map is expanded per layer
    decoder = load_decoder(folder, text_meta, config.text, key_map(config.text), text)

    # the layers past the one the projector reads, and the final norm, are never run: not loaded
    n_used = config.vision.n_layers
    unused = re.compile(r"^vision\.(encoder\.layers\.(\d+)\.|post_layernorm\.|embeddings\.position_ids$)")
    for k in list(sd):
        if (hit := unused.match(k)) and (hit.group(2) is None or int(hit.group(2)) >= n_used):
            del sd[k]
    model = build_skeleton(lambda: LLaVA(config, language_model=decoder))
    parts = nn.Module()  # what the file fills: the tower and the projector (the decoder is loaded)
    parts.vision, parts.projector = model.vision, model.projector
    transforms = {"vision.embeddings.class_embedding": lambda t: t.reshape(1, 1, -1),
                  "vision.embeddings.position_embedding.weight": lambda t: t.unsqueeze(0)}
    mapping = vision_key_map(n_used, patch_bias, linear, config.projector_bias)
    load_hf_weights(parts, sd, mapping, transforms=transforms, source=sd.source)
    parts.to(decoder.lm_head.weight.dtype)  # one dtype for the whole model, as transformers loads it
    # the token ids: the text config's, and the top level's (llava-hf puts pad_token_id there)
    ids = {k: meta[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if meta.get(k) is not None}
    model.folder_generation_config = {**decoder.folder_generation_config, **ids}
    return model.eval()


def export_llava(model: LLaVA, out: str | os.PathLike, source: str | os.PathLike) -> Path:
    """OUT as a Hugging Face llava folder (transformers 5's key layout): the language model and the projector
    from `model`, the vision tower (every layer, including those qkv never runs) and config.json from
    `source`."""
    # qkv's tower is cut at the layer the projector reads, so the tower is copied from the source folder (the
    # chat recipe freezes it: that copy is the trained model's)
    model, source = unwrap(model), Path(source)
    state = {"model.vision_tower.vision_model." + k[len("vision."):]: t
             for k, t in source_tensors(source, canonical_key, "vision.").items()}
    state.update(language_state(model.language_model, "model.language_model.")[0])
    for k, t in model.projector.state_dict().items():
        state["model.multi_modal_projector." + k] = t.detach().contiguous()
    return write_vlm_folder(out, state, read_config(source), source)


def write_llava(model: LLaVA, out: Path, request: ExportRequest) -> None:
    if request.source is None:
        raise CheckpointError("a llava folder is written from the folder its model was loaded from (its "
                              "vision tower); none was given")
    export_llava(model, out, request.source)


register(ModelType("llava", "decoder", "llava", load_llava, write_llava))


# -- the processor: images -> pixel_values, <image> -> placeholders
# ---------------------------------------------
def _size(value: Any, what: str) -> tuple[int, int] | int:
    """preprocessor_config.json's size / crop_size -> (height, width), or an int shortest edge."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, dict):
        if "height" in value and "width" in value:
            return int(value["height"]), int(value["width"])
        if set(value) == {"shortest_edge"}:
            return int(value["shortest_edge"])
    raise CheckpointError(f"preprocessor_config.json: {what} {value!r} is not supported "
                          "({'shortest_edge': n} or {'height': h, 'width': w})")


@dataclass
class ImageProcessor:
    """CLIPImageProcessor's (and SiglipImageProcessor's) preprocessing with PIL and torch."""

    size: tuple[int, int] | int = 224  # (height, width), or the shortest edge (aspect kept)
    crop: tuple[int, int] | None = (224, 224)
    resample: int = 3  # PIL's code: 3 = bicubic
    rescale_factor: float | None = 1 / 255
    mean: tuple[float, ...] | None = (0.48145466, 0.4578275, 0.40821073)
    std: tuple[float, ...] | None = (0.26862954, 0.26130258, 0.27577711)
    resize: bool = True

    @classmethod
    def from_folder(cls, folder: str | Path) -> ImageProcessor:
        path = Path(folder) / "preprocessor_config.json"
        if not path.is_file():
            raise CheckpointError(
                f"{folder}: no preprocessor_config.json (the image preprocessing of the folder)"
            )
        try:
            p = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None
        kind = p.get("image_processor_type", "CLIPImageProcessor")
        siglip = kind in ("SiglipImageProcessor", "SiglipImageProcessorFast", "SiglipImageProcessorPil")
        require(siglip or kind in ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil"),
                f"{path}: image_processor_type {kind!r} is not supported (CLIPImageProcessor and "
                "SiglipImageProcessor only)")
        require(not p.get("do_pad", False), f"{path}: do_pad is not supported")
        def on(flag: str) -> bool:  # CLIPImageProcessor's steps are all on by default; SigLIP does not crop
            return bool(p.get(flag, not (siglip and flag == "do_center_crop")))

        # SiglipImageProcessor: a square resize, no crop, mean = std = 0.5 (IMAGENET_STANDARD)
        mean, std = ((0.5, 0.5, 0.5),) * 2 if siglip else (cls.mean, cls.std)
        crop = _size(p.get("crop_size", 224), "crop_size")
        return cls(size=_size(p.get("size", {"height": 224, "width": 224} if siglip else 224), "size"),
                   resize=on("do_resize"),
                   crop=((crop, crop) if isinstance(crop, int) else crop) if on("do_center_crop") else None,
                   resample=int(p.get("resample", 3)),
                   rescale_factor=float(p.get("rescale_factor", 1 / 255)) if on("do_rescale") else None,
                   mean=tuple(p.get("image_mean", mean)) if on("do_normalize") else None,
                   std=tuple(p.get("image_std", std)) if on("do_normalize") else None)

    def _resize(self, image: Any) -> Any:
        w, h = image.size
        if isinstance(
            self.size, int
        ):  # the shortest edge to `size`, the longest in proportion (rounded down)
            short, long = (w, h) if w <= h else (h, w)
            new_long = int(self.size * long / short)
            h, w = (new_long, self.size) if w <= h else (self.size, new_long)
        else:
            h, w = self.size
        return image.resize((w, h), resample=self.resample)

    def __call__(self, images: Any) -> Tensor:
        """A PIL image or a list of them -> pixel_values (n, 3, H, W) float32."""
        out = []
        for image in images if isinstance(images, (list, tuple)) else [images]:
            image = image.convert("RGB")
            if self.resize:
                image = self._resize(image)
            x = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)  # (3, H, W) uint8
            if self.crop is not None:
                x = _center_crop(x, self.crop)
            x = x.double() * self.rescale_factor if self.rescale_factor is not None else x.double()
            x = x.float()
            if self.mean is not None and self.std is not None:
                x = (x - torch.tensor(self.mean).view(-1, 1, 1)) / torch.tensor(self.std).view(-1, 1, 1)
            out.append(x)
        return torch.stack(out)


def _center_crop(x: Tensor, crop: tuple[int, int]) -> Tensor:
    H, W = x.shape[-2:]
    h, w = crop
    if h > H or w > W:
        raise ValueError(
            f"the resized image ({H}x{W}) is smaller than the crop ({h}x{w}): padding is not supported"
        )
    top, left = (H - h) // 2, (W - w) // 2
    return x[:, top:top + h, left:left + w]


def load_image(path: str | Path) -> Any:
    """A PIL image from a file, or a ValueError that says why not (missing, not an image, over
    qkv.image_io's limits)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such image file")
    return open_image(p, str(path))


def expand_image_tokens(ids: Sequence[int], image_token_id: int, n: int) -> list[int]:
    """Each image token in `ids` -> n copies (one per patch embedding that replaces it), as LlavaProcessor."""
    out: list[int] = []
    for i in ids:
        out.extend([i] * n if i == image_token_id else [i])
    return out
