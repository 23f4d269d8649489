"""What the chat recipe writes into OUT: the model folder in the source's format (Hugging Face exporters or
qkv's own), the source's tokenizer and generation files, which step's weights it holds (the best dev loss's by
default, as transformers' load_best_model_at_end) and the report's lines saying so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qkv.checkpoint import CheckpointError
from qkv.config import ConfigError
from qkv.interop.export import set_token_ids, writable_types, write_model
from qkv.interop.export_tokenizer import copy_tokenizer_files
from qkv.interop.registry import ExportRequest
from qkv.nn.params import tied_names
from qkv.storage import read_config
from qkv.train.checkpoint import read_checkpoint


def check_exportable(source: Path) -> None:
    """Refuse, before training, a Hugging Face folder whose format OUT could not be written in."""
    model_type = read_config(source).get("model_type")
    decoders = writable_types(kind="decoder")  # a chat model: a decoder, or a vision-language one
    if model_type is not None and model_type not in decoders:
        raise ConfigError(f"cannot write a fine-tuned {model_type!r} folder yet: qkv exports "
                          f"{', '.join(sorted(decoders))} folders")


def save_model_folder(model: torch.nn.Module, source: Path, out: Path) -> str:
    """Write `model` (adapters already merged) into OUT as a model folder of the source's format, plus the
    source's tokenizer and generation files. Returns the format written ("hf:<model_type>" or "qkv")."""
    meta = read_config(source)
    model_type = meta.get("model_type")
    if model_type is not None:
        check_exportable(source)
        # a VLM's processor files: from source (llava: its tower)
        write_model(model, out, ExportRequest(model_type, source))
        # the exporter knows the architecture; the source knows its token ids and anything else it declared
        set_token_ids(out, meta)
        fmt = f"hf:{model_type}"
    else:
        model.save_pretrained(out)
        fmt = "qkv"
    copy_tokenizer_files(source, out)
    return fmt


def final_model(trainer: Any, build: Any, checkpoint: str | None) -> torch.nn.Module:
    """The model to export, on rank 0: the trained one, or `checkpoint`'s weights (the best evaluation's)
    loaded into it. Under FSDP the module is sharded: a rebuilt one gets the full state of `checkpoint`, else
    of the last checkpoint (save_checkpoint gathered both)."""
    fsdp = trainer.dist.mode == "fsdp"
    if not fsdp and checkpoint is None:
        return trainer.model
    model = build() if fsdp else trainer.model
    path = checkpoint or trainer.last_checkpoint
    state, _ = read_checkpoint(path)
    missing, unexpected = model.load_state_dict(state, strict=False)  # a tied weight is stored once
    if set(missing) - tied_names(model) or unexpected:
        raise CheckpointError(f"{path}: does not fit the model (missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]})")
    return model


def best_checkpoint(export: str, summary: dict[str, Any]) -> str | None:
    """The checkpoint to export instead of the last step's weights: the best dev loss's, when --export best
    and an evaluation before the last step was the best (transformers' load_best_model_at_end)."""
    best, path = summary.get("best_eval"), summary.get("best_checkpoint")
    if export != "best" or not best or best.get("step") == summary["steps"] or not path:
        return None
    return path if Path(path).is_dir() else None


def weights_lines(out: Path, fmt: str, lora: Any, summary: dict[str, Any], exported_best: bool) -> list[str]:
    """What the report says of the model folder: which step's weights it holds, and where the best dev loss
    is when that is not them (the training log names the best step: it must not read as what was exported)."""
    source = "Hugging Face " + fmt[3:] if fmt.startswith("hf:") else "qkv"
    kind = f"{source} format{', LoRA merged' if lora else ''}"
    best, steps = summary.get("best_eval"), summary["steps"]
    if exported_best:
        return [f"model folder: {out} ({kind}): the weights of step {best['step']}, the best dev "
                f"{best['metric']} ({best['value']:.4f}; the last step, {steps}, is in "
                f"{summary['checkpoint']}); try: qkv chat {out}"]
    lines = [f"model folder: {out} ({kind}): the weights of the last step, {steps}; try: qkv chat {out}"]
    if best and best.get("step") != steps:
        lines.append(f"the best dev {best['metric']} ({best['value']:.4f}) was at step {best['step']}, not "
                     "in the model folder (--export last): its training checkpoint is "
                     f"{summary['best_checkpoint']}")
    return lines
