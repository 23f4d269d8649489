"""`qkv info` and `qkv presets`: parameter tables by module, the KV cache's bytes per token and a training
step's memory (qkv.memory computes them from the model's config)."""

from __future__ import annotations

import argparse
import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkv.cli.args import InfoArgs
from qkv.cli.flags import read_settings
from qkv.config import ConfigError, memory_bytes

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from qkv.memory import KVCacheSize, TrainMemory

# The config.json fields the KV cache's size is computed from, by qkv family (its "config" section): a field
# missing there would be filled with the family's default, which sizes another model. A Hugging Face folder's
# are its model_type record's (qkv.interop.registry): the loaders default some of them too
QKV_SIZING_FIELDS: dict[str, tuple[str, ...]] = {
    "gpt": ("n_layers", "d_model", "n_heads", "context_length"),
    "encdec": ("n_decoder_layers", "d_model", "n_heads", "context_length"),
    "whisper": ("n_decoder_layers", "d_model", "n_heads", "n_text_ctx", "n_audio_ctx"),
}


def parameter_table(model: nn.Module, depth: int = 2) -> list[tuple[str, int]]:
    """Unique parameters grouped by module path truncated to `depth` components; numeric components
    (block indices) are folded so a 12-layer stack shows as one row `decoder.blocks.*`."""
    rows: OrderedDict[str, int] = OrderedDict()
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        parts = ["*" if part.isdigit() else part for part in name.split(".")[:-1]]
        key = ".".join(parts[: depth + (1 if "*" in parts[:depth] else 0)]) or name
        rows[key] = rows.get(key, 0) + p.numel()
    return list(rows.items())


def format_table(rows: list[tuple[str, int]]) -> str:
    total = sum(n for _, n in rows) or 1
    width = max([len(r[0]) for r in rows] + [6])
    lines = [f"{'module':<{width}}  {'params':>14}  {'share':>6}", "-" * (width + 24)]
    for name, n in rows:
        lines.append(f"{name:<{width}}  {n:>14,}  {100 * n / total:>5.1f}%")
    lines.append("-" * (width + 24))
    lines.append(f"{'total':<{width}}  {total:>14,}  100.0%")
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_kv_cache(kv: KVCacheSize | None, batch: int = 1) -> list[str]:
    if kv is None:
        return ["KV cache: none (this model does not decode token by token with cached keys and values)"]
    dtype = str(kv.dtype).removeprefix("torch.")
    lines = [f"KV cache ({kv.layout}, {dtype}): {kv.n_layers} layers x {kv.per_layer} = "
             f"{kv.numbers_per_token:,} numbers = {kv.bytes_per_token:,} bytes per token"]
    if kv.context:
        rows = f"{batch} sequences" if batch > 1 else "one sequence"
        lines.append(f"  at the model's context ({kv.context:,} tokens), {rows}: "
                     f"{human_bytes(kv.bytes_at(kv.context, batch))}")
    if kv.cross_numbers_per_source_token:
        line = (f"  + the encoder output's cross-attention K and V: {kv.cross_bytes_per_source_token:,} "
                f"bytes per source token")
        if kv.source_context:
            line += (f"; at {kv.source_context:,} source tokens: "
                     f"{human_bytes(kv.bytes_at(0, batch, kv.source_context))}")
        lines.append(line)
    return lines


def format_train_memory(est: TrainMemory, machine: int | None) -> list[str]:
    rows = [("weights", est.weights, est.weights), ("gradients", est.gradients, est.gradients),
            ("optimizer (AdamW's 2 moments)", est.optimizer, est.optimizer),
            ("activations", est.activations, est.activations_checkpointed),
            ("peak of a step", est.peak(False), est.peak(True))]
    lines = [f"training memory estimate (fp32, AdamW), batch {est.batch} x {est.seq} tokens:",
             f"  {'':<30} {'plain':>12} {'checkpointed':>14}"]
    lines += [f"  {name:<30} {human_bytes(a):>12} {human_bytes(b):>14}" for name, a, b in rows]
    lines.append("  (the peak is not the sum: backward frees a block's activations as it makes its "
                 "gradients)")
    if machine:
        fits = ("fits" if est.peak(False) <= machine else "fits only with train.grad_checkpointing=true"
                if est.peak(True) <= machine else "does not fit")
        lines.append(f"  this machine has {human_bytes(machine)}: {fits}")
    return lines


def cmd_info(args: argparse.Namespace) -> int:
    # torch and every family: imported here so that `qkv --help` stays light
    import torch

    import qkv
    from qkv.memory import kv_cache_size, train_memory

    a = read_settings(args, InfoArgs)
    if Path(a.target).exists():
        from qkv.run import load_model_any

        check_sizable(a.target)
        model = load_model_any(a.target)
        title = f"{a.target}: {type(model).__name__}"
        hf_type = hf_model_type(a.target)
        if hf_type:
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
            gguf = hf_type.startswith("GGUF")
            title += f" ({hf_type} file, {dtype})" if gguf else f" (Hugging Face {hf_type} folder, {dtype})"
    # meant as a path, not a preset
    elif "/" in a.target or a.target.startswith((".", "~")) or os.sep in a.target:
        raise ConfigError(f"no such folder: {a.target}")
    else:
        model = qkv.build(a.target)
        title = f"preset {a.target}: {type(model).__name__}"
    print(title)
    print(format_table(parameter_table(model, a.depth)))
    for line in format_kv_cache(kv_cache_size(model, getattr(torch, a.dtype) if a.dtype else None), a.batch):
        print(line)
    if a.train:
        seq = a.seq or getattr(model.config, "context_length", None)
        if seq is None:
            raise ConfigError("--train needs --seq (tokens per sequence): this model's config has no context")
        for line in format_train_memory(train_memory(model, a.batch, seq), memory_bytes()):
            print(line)
    return 0


def _folder_config(path: str) -> dict[str, Any] | None:
    from qkv.run import model_folder

    try:
        meta = json.loads((model_folder(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # read_config, when the model loads, says what is wrong
        return None
    return meta if isinstance(meta, dict) else None


def check_sizable(path: str) -> None:
    """A folder (Hugging Face or qkv) lacking a field the KV cache's size is computed from: one line naming
    it, before anything is loaded."""
    meta = _folder_config(path)
    if meta is None:
        return
    from qkv.interop.registry import lookup

    family, record = meta.get("qkv_family"), lookup(meta.get("model_type"))
    kind, fields = (family, QKV_SIZING_FIELDS.get(str(family), ())) if family is not None else \
        (meta.get("model_type"), record.sizing_fields if record is not None else ())
    section = meta.get("config") if family is not None else meta
    if not isinstance(section, dict):
        return  # the loader says what is wrong with the file
    for field in fields:
        if section.get(field) is None:
            raise ConfigError(f"{path}: config.json lacks {field!r}, which the KV cache's size is computed "
                              f"from ({kind})")


def hf_model_type(path: str) -> str | None:
    from qkv.interop.gguf_model import is_gguf

    if is_gguf(path):
        from qkv.interop.gguf_model import GGUFFile

        return f"GGUF {GGUFFile(path).meta.get('general.architecture')}"
    meta = _folder_config(path)
    return meta.get("model_type") if meta is not None and "qkv_family" not in meta else None
