"""Where a model and its task are: a run folder (task.json + checkpoints/), a checkpoint inside one, a qkv
or Hugging Face model folder, a GGUF file."""

from __future__ import annotations

from pathlib import Path

import torch

import qkv
from qkv.checkpoint import CheckpointError
from qkv.config import ConfigError
from qkv.interop.gguf_model import is_gguf
from qkv.tasks import load_task
from qkv.train import latest_checkpoint


def model_folder(path: str | Path) -> Path:
    """The folder `from_pretrained` reads for `path` (one holding config.json): itself, or a run folder's
    newest checkpoint (a GGUF file is a model folder of its own)."""
    path = Path(path)

    if (path / "config.json").is_file() or is_gguf(path):
        return path
    ck = latest_checkpoint(path / "checkpoints")
    if ck is not None:
        return ck

    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    raise CheckpointError(f"{path} is neither a model folder (config.json) nor a run folder with checkpoints")


def run_folder_of(path: str | Path) -> Path | None:
    """The run folder (holding task.json) that `path` is, or is a checkpoint inside of."""
    p = Path(path).resolve()
    for cand in (p, p.parent, p.parent.parent):
        if (cand / "task.json").is_file():
            return cand
    return None


def load_model_any(path: str | Path, quantize: str | None = None) -> torch.nn.Module:
    """A model from a run folder, a qkv checkpoint folder, or a Hugging Face-format folder; quantize: "int8"
    or "int4" for weight-only quantized inference (qkv.nn.quant)."""
    return qkv.from_pretrained(model_folder(path), quantize=quantize)


def load_run_task(path: str | Path):
    run = run_folder_of(path)
    if run is None:
        raise ConfigError(f"{path} is not inside a qkv run folder (no task.json): it records no task")
    return load_task(run)


def check_out_folder(out: Path) -> None:
    """A one-line ConfigError, before any work, when OUT or a folder above it is an existing file."""
    for p in (out, *out.parents):
        if p.exists() and not p.is_dir():
            raise ConfigError(f"--out {out} is a file, not a folder" if p == out else
                              f"--out {out}: {p} is a file, not a folder")
