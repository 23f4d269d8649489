"""`qkv export SOURCE OUT`: a qkv run, a qkv model folder or a Hugging Face folder written as a Hugging Face
folder (config.json + model.safetensors + tokenizer files) that transformers loads.

Each model_type is written by its record's exporter (qkv.interop.registry), told what the run knows: an
encoder's class names (its task's), an image classifier's class names and preprocessing (`qkv predict`'s).
The model type is chosen from the model's family and config (a GPT with
learned positions: gpt2; with RoPE: llama / qwen2 / qwen3 / mistral; experts: mixtral / qwen2_moe /
qwen3_moe; MLA: deepseek_v3; an encoder: bert; an image classifier: its own), or given. A config the format
cannot express is refused by the exporter's own check, and OUT is written in a folder beside it that becomes
OUT only when everything is in it: a refusal leaves nothing behind (the parent folders made for OUT are
removed too).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkv.config import ConfigError
from qkv.interop.classifier import preprocessor_config
from qkv.interop.common import require
from qkv.interop.export import check_model, decoder_type, set_token_ids, writable_types, write_model
from qkv.interop.export_tokenizer import copy_tokenizer_files
from qkv.interop.gguf_model import is_gguf
from qkv.interop.registry import ExportRequest, lookup, model_types
from qkv.interop.tokenizer import load_hf_tokenizer
from qkv.predict import preprocessing_for
from qkv.run import hugging_face_tokenizer_files, load_model_any, load_run_task, model_folder, run_folder_of
from qkv.storage import read_config, umask_mode
from qkv.tasks.tokenizer_export import write_qkv_tokenizer
from qkv.tasks.tokenizers import saved_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Exported:
    """What export_model wrote."""

    out: Path
    model_type: str
    dtype: str
    tokenizer: str | None  # "copied", "char", "word", "bpe", or None (none written)
    files: list[str] = field(default_factory=list)


def choose_model_type(model: Any, meta: dict[str, Any], asked: str | None) -> str:
    """`asked`, checked against the model's family; else the default for the model (a Hugging Face folder:
    its own model_type)."""
    fam = type(model).family
    # the types a model of its family can be written as: the first registered is an encoder's default
    types, written = writable_types(fam), writable_types()
    if not types:
        families = sorted({r.family for r in model_types(writable=True)})
        raise ConfigError(f"qkv export has no Hugging Face format for a {type(model).__name__} ({fam!r} "
                          f"family) model; it writes {', '.join(families)} models")
    hf_type = meta.get("model_type") if "qkv_family" not in meta else None
    chosen = asked or hf_type or (decoder_type(model.config) if fam == "gpt" else types[0])
    if chosen not in written and asked is None:  # the folder's own type, not a flag the user gave
        raise ConfigError(f"a Hugging Face {chosen} folder has no exporter; pass --model-type, one of "
                          f"{', '.join(types)}")
    if chosen not in written:
        raise ConfigError(f"--model-type {chosen!r}: qkv writes {', '.join(sorted(written))} folders")
    if chosen not in types:
        raise ConfigError(f"a {type(model).__name__} cannot be written as {chosen!r}: choose one of "
                          f"{', '.join(types)}")
    if fam == "llava" and chosen != hf_type:
        raise ConfigError(f"a vision-language model is written from the {chosen} folder it was loaded from "
                          f"(its vision tower and processor files): {meta.get('model_type')!r} is not one")
    return chosen


def check_paths(source: Path, out: Path, force: bool) -> None:
    """Refuse, before any loading: a missing SOURCE, a GGUF file, an OUT that is or holds what is read
    (SOURCE, the model folder in it, its run folder) or the working folder, a symlink OUT and an OUT in
    use."""
    if not source.exists():
        raise FileNotFoundError(f"no such run or model folder: {source}")

    if is_gguf(source):  # no config.json to keep, no tokenizer files to copy: its format is llama.cpp's
        raise ConfigError(f"{source} is a GGUF file: qkv export writes runs and model folders")
    dst = out.resolve()
    read = [source.resolve(), model_folder(source).resolve(), run_folder_of(source)]
    if any(dst == p or dst in p.parents for p in read if p is not None):
        raise ConfigError(f"OUT ({out}) must be a new folder, not SOURCE, its model or run folder, or a "
                          "folder holding them")
    if out.is_symlink():  # --force would empty the folder it points to, wherever that is
        raise ConfigError(f"OUT ({out}) is a symbolic link; give the folder itself")
    cwd = Path.cwd().resolve()
    if dst == cwd or dst in cwd.parents:
        raise ConfigError(f"OUT ({out}) is the working folder or holds it; give a new folder")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"OUT ({out}) is a file")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"OUT ({out}) exists and is not empty; pass --force to replace it")


@contextmanager
def _filesystem(what: str, path: Path) -> Iterator[None]:
    """An OSError (no permission, a full disk, a read-only file system) as one line naming `path`."""
    try:
        yield
    except OSError as e:
        raise ConfigError(f"cannot {what} {path}: {e.strerror or e}") from None


def _new_parents(out: Path) -> Path | None:
    """The outermost missing folder above `out` (None when its parent exists): what mkdir will create."""
    missing = [p for p in out.absolute().parents if not p.exists()]
    return missing[-1] if missing else None


def _remove_new_parents(out: Path, first: Path | None) -> None:
    """Remove the empty folders created above `out`, up to and including `first`."""
    if first is None:
        return
    d = out.absolute().parent
    while True:
        try:
            d.rmdir()
        except OSError:  # not empty (something else wrote there meanwhile): left alone
            return
        if d == first:
            return
        d = d.parent


def export_model(source: str | os.PathLike, out: str | os.PathLike, *, model_type: str | None = None,
                 dtype: str | None = None, force: bool = False) -> Exported:
    """Write the model of `source` (a run folder, a checkpoint in one, a qkv or Hugging Face model folder)
    into the new folder `out` as a Hugging Face `model_type` folder with its tokenizer."""
    source, out = Path(source), Path(out)
    check_paths(source, out, force)
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    folder = model_folder(source)
    meta = read_config(folder)
    model = load_model_any(source).eval()
    chosen = choose_model_type(model, meta, model_type)
    if dtype is not None:
        if lookup(chosen).kind == "image":  # its exporter writes float32 (what the parity checks hold)
            raise ConfigError(f"--dtype: qkv export writes an image classifier in float32; drop "
                              f"--dtype {dtype}")
        model = model.to(DTYPES[dtype])
    first_new = _new_parents(out)
    done = False
    try:
        tokenizer, files = _write_staged(model, chosen, source, folder, meta, out)
        done = True
    finally:
        if not done:
            _remove_new_parents(out, first_new)
    written = str(next(model.parameters()).dtype).removeprefix("torch.")
    return Exported(out, chosen, written, tokenizer, files)


def _write_staged(model: Any, model_type: str, source: Path, folder: Path, meta: dict[str, Any],
                  out: Path) -> tuple[str | None, list[str]]:
    """The model and its tokenizer written in a new folder beside `out` that then replaces it: the tokenizer
    written and the files."""
    with _filesystem("create", out.parent):
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        staging.chmod(umask_mode("dir"))  # mkdtemp's is owner-only: OUT gets a new folder's usual mode
        write_model(model, staging, _request(model, model_type, folder))
        original = folder / "preprocessor_config.json"  # a Hugging Face classifier's own, kept as it was
        if lookup(model_type).kind == "image" and "qkv_family" not in meta and original.is_file():
            shutil.copyfile(original, staging / original.name)
        tokenizer = _write_tokenizer(model, model_type, source, folder, meta, staging)
        files = sorted(p.name for p in staging.iterdir())
        with _filesystem("replace", out):
            if out.exists():
                shutil.rmtree(out)
            staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return tokenizer, files


def _write_tokenizer(model: Any, model_type: str, source: Path, folder: Path, meta: dict[str, Any],
                     out: Path) -> str | None:
    """The tokenizer files beside the model (an image classifier has none), and a decoder's token ids."""
    record = lookup(model_type)
    if record.kind == "image" or record.family == "llava":  # a VLM's exporter copies its own files
        return None
    decoder = record.family == "gpt"
    if "qkv_family" not in meta:  # a Hugging Face folder: its files as they are, its token ids
        copied = copy_tokenizer_files(folder, out)
        if decoder:
            set_token_ids(out, meta)
        return "copied" if copied else None
    if hugging_face_tokenizer_files(folder):  # a qkv model folder the chat recipe wrote: its files, template
        copy_tokenizer_files(folder, out)  # included, as they are
        if decoder:
            hf = load_hf_tokenizer(folder)
            set_token_ids(out, {"bos_token_id": hf.bos_token_id, "eos_token_id": hf.eos_token_id,
                                "pad_token_id": hf.pad_token_id})
        return "copied"
    run = run_folder_of(source)
    folders = [folder] + ([run] if run else [])
    tok = saved_tokenizer(folders)
    if tok is not None:
        kind = write_qkv_tokenizer(tok, out, getattr(model.config, "context_length", None),
                                   _prepends_bos(model, run))
        if kind is not None and decoder:
            set_token_ids(out, {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id,
                                "pad_token_id": tok.pad_id})
        return kind
    # a qkv folder carrying a Hugging Face tokenizer (the chat recipe's OUT from a qkv source): its files
    if any(copy_tokenizer_files(d, out) for d in folders):  # the first folder holding them
        return "copied"

    warnings.warn(f"no tokenizer found with {source}: the folder holds the model only", stacklevel=2)
    return None


def _prepends_bos(model: Any, run: Path | None) -> bool:
    """Does the model read <bos> first? Only a model that pools its first token can (qkv's tasks put <bos>
    there as BERT's [CLS]); its run's task says whether it did (ListOps does), else it is taken to. Other
    runs' tasks are not loaded (their data need not be where it was)."""
    if not type(model).pools_first_token:
        return False
    if run is None:
        return True

    return bool(getattr(load_run_task(run), "pools_first_token", False))


def _run_classes(source: Path) -> dict[int, str] | None:
    """Class names of the task a qkv run was trained on, by id (None without a run or classes)."""
    if run_folder_of(source) is None:
        return None
    classes = getattr(load_run_task(source), "classes", None)
    return dict(enumerate(map(str, classes))) if classes else None


def _request(model: Any, model_type: str, folder: Path) -> ExportRequest:
    """What the exporter is told beyond the model: an encoder's class names (its run's task's; a Hugging Face
    folder's own are read by the exporter), an image classifier's and its preprocessing (`qkv predict`'s)."""
    kind = lookup(model_type).kind
    if kind == "encoder":
        return ExportRequest(model_type, folder, labels=_run_classes(folder))
    if kind != "image":
        return ExportRequest(model_type, folder)
    c = model.config
    require(c.head == "classify", f"qkv export writes image classifiers; this {type(model).__name__} has "
                                  f"head {c.head!r}")
    check_model(model, ExportRequest(model_type, folder))  # the config's refusal, before the run's task loads
    pre, labels = preprocessing_for(folder, model)
    mean, std = pre.mean or [0.0] * c.n_channels, pre.std or [1.0] * c.n_channels
    preprocessor = preprocessor_config(c.image_size, mean, std)
    return ExportRequest(model_type, folder, dict(enumerate(labels)), preprocessor)


__all__ = ["DTYPES", "Exported", "check_paths", "choose_model_type", "export_model"]
