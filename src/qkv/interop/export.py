"""`qkv export SOURCE OUT`: a qkv run, a qkv model folder or a Hugging Face folder written as a Hugging Face
folder (config.json + model.safetensors + tokenizer files) that transformers loads.

EXPORTERS is the one table of Hugging Face model_type -> the function that writes that format; the fine-tune
recipes (qkv.finetune.chat_output) write their OUT through it too. The model type is chosen from the model's
family and config (a GPT with learned positions: gpt2; with RoPE: llama / qwen2 / qwen3 / mistral; experts:
mixtral / qwen2_moe / qwen3_moe; MLA: deepseek_v3; an encoder: bert; an image classifier: its own), or
given. A config the format cannot express is refused by the exporter's own check, and OUT is written in a
folder beside it that becomes OUT only when everything is in it: a refusal leaves nothing behind.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkv.config import ConfigError
from qkv.interop.export_tokenizer import TOKENIZER_FILES, copy_tokenizer_files  # noqa: F401  (re-exported)

_DECODERS = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
# Hugging Face model_type -> "module:function(model, folder)" writing that format (what transformers loads);
# a function taking `model_type` or `source` (the folder or run the model came from) is given them
EXPORTERS = {"gpt2": "qkv.interop.gpt2:export_gpt2", **{mt: "qkv.interop.llama:export_llama" for mt in
                                                      ("llama", "mistral", "qwen2", "qwen3")},
             **{mt: "qkv.interop.moe:export_moe" for mt in ("mixtral", "qwen2_moe", "qwen3_moe")},
             "deepseek_v3": "qkv.interop.deepseek:export_deepseek",
             "llava": "qkv.interop.vlm_export:export_llava",
             **{mt: "qkv.interop.vlm_export:export_idefics3" for mt in ("idefics3", "smolvlm")},
             **{mt: "qkv.interop.export:export_encoder_folder" for mt in
                ("bert", "roberta", "xlm-roberta", "distilbert", "deberta-v2")},
             **{mt: "qkv.interop.export:export_image_folder" for mt in ("vit", "resnet", "swin")}}
# qkv family -> the model types its models can be written as (the first: an encoder's default)
FAMILY_TYPES = {"gpt": _DECODERS, "bert": ("bert", "roberta", "xlm-roberta", "distilbert"),
                "deberta": ("deberta-v2",), "vit": ("vit",), "resnet": ("resnet",), "swin": ("swin",),
                "llava": ("llava", "idefics3", "smolvlm")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Exported:
    """What export_model wrote."""

    out: Path
    model_type: str
    dtype: str
    tokenizer: str | None  # "copied", "char", "word", "bpe", or None (none written)
    files: list[str] = field(default_factory=list)


def write_model(model: torch.nn.Module, out: Path, model_type: str, source: Path | None = None) -> None:
    """`model` as a Hugging Face `model_type` folder in `out`, by the EXPORTERS entry for that type."""
    if model_type not in EXPORTERS:
        raise ConfigError(f"no Hugging Face exporter for model_type {model_type!r}: qkv writes "
                          f"{', '.join(sorted(EXPORTERS))} folders")
    module, _, name = EXPORTERS[model_type].partition(":")
    fn = getattr(importlib.import_module(module), name)
    params = inspect.signature(fn).parameters
    fn(model, out, **({"model_type": model_type} if "model_type" in params else {}),
       **({"source": source} if "source" in params else {}))


def set_token_ids(out: Path, ids: dict[str, Any]) -> None:
    """config.json's bos/eos/pad token ids set to `ids` (one absent from `ids` is removed): the exporter
    knows the architecture, the tokenizer its ids."""
    from qkv.storage import atomic_write_json

    written = json.loads((out / "config.json").read_text(encoding="utf-8"))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in ids:
            written[key] = ids[key]
        else:
            written.pop(key, None)
    atomic_write_json(written, out / "config.json")


def decoder_type(config: Any) -> str:
    """The Hugging Face model_type a qkv GPT config is written as (its exporter then checks the rest)."""
    if config.mla.enabled:
        return "deepseek_v3"
    if config.moe.n_experts:
        from qkv.interop.moe import model_type_of

        return model_type_of(config)
    if config.position == "learned":
        return "gpt2"
    from qkv.interop.llama import model_type_of

    return model_type_of(config)


def choose_model_type(model: Any, meta: dict[str, Any], asked: str | None) -> str:
    """`asked`, checked against the model's family; else the default for the model (a Hugging Face folder:
    its own model_type)."""
    fam = type(model).family
    types = FAMILY_TYPES.get(fam)
    if types is None:
        raise ConfigError(f"qkv export has no Hugging Face format for a {type(model).__name__} ({fam!r} "
                          f"family) model; it writes {', '.join(sorted(FAMILY_TYPES))} models")
    hf_type = meta.get("model_type") if "qkv_family" not in meta else None
    chosen = asked or hf_type or (decoder_type(model.config) if fam == "gpt" else types[0])
    if chosen not in EXPORTERS:
        raise ConfigError(f"--model-type {chosen!r}: qkv writes {', '.join(sorted(EXPORTERS))} folders")
    if chosen not in types:
        raise ConfigError(f"a {type(model).__name__} cannot be written as {chosen!r}: choose one of "
                          f"{', '.join(types)}")
    if fam == "llava" and chosen != hf_type:
        raise ConfigError(f"a vision-language model is written from the {chosen} folder it was loaded from "
                          f"(its vision tower and processor files): {meta.get('model_type')!r} is not one")
    return chosen


def check_paths(source: Path, out: Path, force: bool) -> None:
    """Refuse a missing SOURCE, a GGUF file, OUT = SOURCE (or holding it) and an OUT in use, before any
    loading."""
    if not source.exists():
        raise FileNotFoundError(f"no such run or model folder: {source}")
    from qkv.interop.gguf_model import is_gguf

    if is_gguf(source):  # no config.json to keep, no tokenizer files to copy: its format is llama.cpp's
        raise ConfigError(f"{source} is a GGUF file: qkv export writes runs and model folders")
    src, dst = source.resolve(), out.resolve()
    if dst == src or dst in src.parents:
        raise ConfigError(f"OUT ({out}) must be a new folder, not SOURCE or a folder holding it")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"OUT ({out}) is a file")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"OUT ({out}) exists and is not empty; pass --force to replace it")


def export_model(source: str | os.PathLike, out: str | os.PathLike, *, model_type: str | None = None,
                 dtype: str | None = None, force: bool = False) -> Exported:
    """Write the model of `source` (a run folder, a checkpoint in one, a qkv or Hugging Face model folder)
    into the new folder `out` as a Hugging Face `model_type` folder with its tokenizer."""
    from qkv.run import load_model_any, model_folder
    from qkv.storage import read_config, umask_mode

    source, out = Path(source), Path(out)
    check_paths(source, out, force)
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    folder = model_folder(source)
    meta = read_config(folder)
    model = load_model_any(source).eval()
    chosen = choose_model_type(model, meta, model_type)
    if dtype is not None:
        model = model.to(DTYPES[dtype])
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(umask_mode("dir"))  # mkdtemp's is owner-only: OUT gets a new folder's usual mode
    try:
        write_model(model, staging, chosen, folder)
        tokenizer = _write_tokenizer(model, chosen, source, folder, meta, staging)
        files = sorted(p.name for p in staging.iterdir())
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    written = str(next(model.parameters()).dtype).removeprefix("torch.")
    return Exported(out, chosen, written, tokenizer, files)


def _write_tokenizer(model: Any, model_type: str, source: Path, folder: Path, meta: dict[str, Any],
                     out: Path) -> str | None:
    """The tokenizer files beside the model (an image classifier has none), and a decoder's token ids."""
    from qkv.interop.export_tokenizer import qkv_tokenizer_of, write_qkv_tokenizer
    from qkv.run import run_folder_of

    if type(model).family in ("vit", "resnet", "swin", "llava"):  # a VLM's exporter copies its own files
        return None
    if "qkv_family" not in meta:  # a Hugging Face folder: its files as they are, its token ids
        copied = copy_tokenizer_files(folder, out)
        if model_type in _DECODERS:
            set_token_ids(out, meta)
        return "copied" if copied else None
    run = run_folder_of(source)
    tok = qkv_tokenizer_of([folder] + ([run] if run else []))
    if tok is None:
        import warnings

        warnings.warn(f"no tokenizer found with {source}: the folder holds the model only", stacklevel=2)
        return None
    kind = write_qkv_tokenizer(tok, out, getattr(model.config, "context_length", None))
    if kind is not None and model_type in _DECODERS:
        set_token_ids(out, {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id,
                            "pad_token_id": tok.pad_id})
    return kind


def _hf_meta(source: Path) -> dict[str, Any] | None:
    """The config.json of a Hugging Face folder (None for a qkv folder or run)."""
    from qkv.run import model_folder
    from qkv.storage import read_config

    meta = read_config(model_folder(source))
    return None if "qkv_family" in meta else meta


def _run_classes(source: Path) -> dict[int, str] | None:
    """Class names of the task a qkv run was trained on, by id (None without a run or classes)."""
    from qkv.run import load_run_task, run_folder_of

    if run_folder_of(source) is None:
        return None
    classes = getattr(load_run_task(source), "classes", None)
    return dict(enumerate(map(str, classes))) if classes else None


def export_encoder_folder(model: Any, out: Path, *, model_type: str, source: Path) -> Path:
    """A BERT-like encoder as a `model_type` folder; the class names from the source folder's config.json,
    else from the run's task."""
    from qkv.interop.bert import BERT_LAYOUT, export_encoder

    if model_type == "distilbert":
        from qkv.interop.distilbert import DISTILBERT_LAYOUT as layout
    elif model_type == "deberta-v2":
        from qkv.interop.deberta import DEBERTA_LAYOUT as layout
    elif model_type in ("roberta", "xlm-roberta"):
        from qkv.interop.roberta import ROBERTA_LAYOUT, XLM_ROBERTA_LAYOUT

        layout = XLM_ROBERTA_LAYOUT if model_type == "xlm-roberta" else ROBERTA_LAYOUT
    else:
        layout = BERT_LAYOUT
    base = _hf_meta(source)
    names = (base or {}).get("id2label")
    id2label = {int(i): str(n) for i, n in names.items()} if isinstance(names, dict) else _run_classes(source)
    if id2label is not None and len(id2label) != getattr(model.config, "num_labels", None):
        id2label = None  # a head the names do not describe (or none): numbered labels
    return export_encoder(model, out, layout, base_config=base, id2label=id2label)


def export_image_folder(model: Any, out: Path, *, source: Path) -> Path:
    """An image classifier (ViT, ResNet, Swin) as a Hugging Face *ForImageClassification folder, with the
    preprocessing and class names `qkv predict` uses for `source`."""
    from qkv.finetune.image_export import check_exportable, export_classifier, preprocessor_config
    from qkv.interop.common import require
    from qkv.predict import preprocessing_for

    c = model.config
    require(c.head == "classify", f"qkv export writes image classifiers; this {type(model).__name__} has "
                                  f"head {c.head!r}")
    base = _hf_meta(source)
    check_exportable(model, base)  # the config's refusal, before the weights' names are looked up
    pre, labels = preprocessing_for(source, model)
    mean, std = pre.mean or [0.0] * c.n_channels, pre.std or [1.0] * c.n_channels
    export_classifier(model.float(), out, base, dict(enumerate(labels)),
                      preprocessor_config(c.image_size, mean, std))
    from qkv.run import model_folder

    original = model_folder(source) / "preprocessor_config.json"
    if base is not None and original.is_file():  # a Hugging Face folder's own preprocessing, as it was
        shutil.copyfile(original, Path(out) / "preprocessor_config.json")
    return Path(out)


__all__ = ["DTYPES", "EXPORTERS", "FAMILY_TYPES", "TOKENIZER_FILES", "Exported", "choose_model_type",
           "copy_tokenizer_files", "decoder_type", "export_encoder_folder", "export_image_folder",
           "export_model", "set_token_ids", "write_model"]
