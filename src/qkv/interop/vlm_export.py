"""qkv's vision-language models (models/vlm.py) -> Hugging Face folders that transformers loads: `llava`
(LlavaForConditionalGeneration) and `idefics3` / `smolvlm` (Idefics3- / SmolVLMForConditionalGeneration).

Both families are the same three parts under other key prefixes, so one writer serves them:
  - the language model: written by the Llama exporter (interop/llama.py), its "model." keys moved under the
    family's prefix ("lm_head." stays), its config.json becoming the folder's text_config;
  - the vision tower and the projector: the family's own keys;
  - the folder's other files (the processor, tokenizer and chat template configs) carried over from the
    source folder unchanged.

LLaVA's tower in qkv is cut at the layer the projector reads (the layers after it are never run), so a llava
export needs its source folder and copies the tower from there; the chat recipe freezes the tower, so that
copy is the trained model's. Idefics3 / SmolVLM run every layer: the tower is written from the model itself,
the folder's config.json built from the model's config. Its position table is the one exception: the model
holds the rows Idefics3's bucketed lookup reads, in patch order (interop/smolvlm.py); for some grid sides
(19, 25, ...) that lookup reads a row twice and another never, and such a row is taken from the source folder
when one is given (zeros otherwise: transformers reads it for no full tile).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.interop.common import export_state, require, write_hf_folder
from qkv.storage import unwrap

# the source folder's processor files, carried into the export with its tokenizer, chat template and
# generation files (config.json is written, the weights are the model's). A list, not a pattern: a folder may
# hold other JSON (a training run's records) that does not describe the exported model.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def language_state(model: torch.nn.Module, prefix: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The language model's tensors under Hugging Face names ("model." -> `prefix`, "lm_head." kept) and its
    config.json (the text_config of the vision-language folder), as the Llama exporter writes them."""
    from safetensors.torch import load_file

    from qkv.interop.llama import export_llama

    with tempfile.TemporaryDirectory() as tmp:
        export_llama(model, tmp)
        text_config = json.loads((Path(tmp) / "config.json").read_text(encoding="utf-8"))
        state = {k if k.startswith("lm_head.") else prefix + k[len("model."):]: t
                 for k, t in load_file(Path(tmp) / "model.safetensors").items()}
    return state, text_config


def source_tensors(source: Path, canonical_key: Callable[[str], str], keep: str) -> dict[str, Tensor]:
    """The source folder's tensors whose canonical name starts with `keep`, read alone (a 7B folder's
    language model is never loaded for this)."""
    from safetensors import safe_open

    out: dict[str, Tensor] = {}
    for f in sorted(Path(source).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():  # noqa: SIM118  (safe_open is not a mapping)
                if canonical_key(k).startswith(keep):
                    out[canonical_key(k)] = sf.get_tensor(k)
    return out


def write_vlm_folder(out: str | os.PathLike, state: dict[str, Tensor], hf_config: dict[str, Any],
                     source: str | os.PathLike | None) -> Path:
    """config.json and model.safetensors, plus the source folder's processor, tokenizer and chat template
    files (never a file onto itself)."""
    from qkv.interop.export_tokenizer import copy_tokenizer_files

    out = write_hf_folder(out, state, hf_config)
    if source is not None:
        copy_tokenizer_files(Path(source), out, also=PROCESSOR_FILES)
    return out


# -- llava ----------------------------------------------------------------------------------------------
def export_llava(model: torch.nn.Module, out: str | os.PathLike, source: str | os.PathLike) -> Path:
    """OUT as a Hugging Face llava folder (transformers 5's key layout): the language model and the projector
    from `model`, the vision tower (every layer, including those qkv never runs) and config.json from
    `source`."""
    from qkv.interop.llava import canonical_key
    from qkv.storage import read_config

    model, source = unwrap(model), Path(source)
    state = {"model.vision_tower.vision_model." + k[len("vision."):]: t
             for k, t in source_tensors(source, canonical_key, "vision.").items()}
    state.update(language_state(model.language_model, "model.language_model.")[0])
    for k, t in model.projector.state_dict().items():
        state["model.multi_modal_projector." + k] = t.detach().contiguous()
    return write_vlm_folder(out, state, read_config(source), source)


# -- idefics3 / smolvlm -----------------------------------------------------------------------------------
IDEFICS3_PREFIXES = {"vision.": "model.vision_model.", "projector.": "model.connector.modality_projection."}
ARCHITECTURES = {"idefics3": "Idefics3ForConditionalGeneration", "smolvlm": "SmolVLMForConditionalGeneration"}
HF_ACTIVATIONS = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu", "relu": "relu"}  # hf_activation inverted


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
    from qkv.interop.smolvlm import navit_position_ids

    pos = pos.detach()[0]
    table = source_table.to(pos.dtype).clone() if source_table is not None else torch.zeros_like(pos)
    table[navit_position_ids(side)] = pos
    return table


def export_idefics3(model: torch.nn.Module, out: str | os.PathLike, *, model_type: str = "idefics3",
                    source: str | os.PathLike | None = None) -> Path:
    """OUT as a Hugging Face idefics3 / smolvlm folder (config.json and model.safetensors, in the model's
    dtype) that transformers loads as Idefics3- / SmolVLMForConditionalGeneration; `source` (the folder it
    was loaded from) gives the processor, tokenizer and chat template files and any position row the model
    never reads."""
    from qkv.interop.smolvlm import canonical_key, vision_key_map

    model = unwrap(model)
    config = model.config
    state, text_config = language_state(model.language_model, "model.text_model.")
    hf_config = idefics3_config_to_hf(config, text_config, model_type)
    pos_key = "vision.embeddings.position_embedding.weight"
    source_table = source_tensors(Path(source), canonical_key, pos_key).get(pos_key) if source else None
    side = config.vision.image_size // config.vision.patch_size
    ours = {"vision." + k: t for k, t in model.vision.state_dict().items()}
    ours.update({"projector." + k: t for k, t in model.projector.state_dict().items()})
    parts = export_state(ours, vision_key_map(config.vision.n_layers),
                         transforms={pos_key: lambda t: _position_table(t, side, source_table)})
    for k, t in parts.items():
        head = next(p for p in IDEFICS3_PREFIXES if k.startswith(p))
        state[IDEFICS3_PREFIXES[head] + k[len(head):]] = t
    return write_vlm_folder(out, state, hf_config, source)


__all__ = ["export_idefics3", "export_llava", "idefics3_config_to_hf", "language_state", "source_tensors",
           "write_vlm_folder"]
