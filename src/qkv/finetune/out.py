"""What `qkv finetune` may do to OUT: refuse, before anything is read or written, a folder whose contents a
run would destroy (check_out), and mark OUT as a recipe's own once its run starts (mark_out), so that an
interrupted run can be recognised and resumed."""

from __future__ import annotations

import json
import os
from pathlib import Path

from qkv.config import ConfigError
from qkv.run.folders import check_out_folder
from qkv.storage import atomic_write_json
from qkv.train import latest_checkpoint
from qkv.train.distributed import launched_by_torchrun

FINETUNE_FILE = "finetune.json"  # in OUT: the recipe that wrote it, its settings and results


def written_by(folder: Path) -> str | None:
    """The recipe whose output `folder` is (its finetune.json's "recipe", or "task" in older classify/tag
    folders), or None when qkv finetune did not write it."""
    try:
        meta = json.loads((folder / FINETUNE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = meta.get("recipe") or meta.get("task") if isinstance(meta, dict) else None
    return name if isinstance(name, str) else None


def check_out(out: str | Path, source: str | Path, recipe: str, resume: bool) -> None:
    """Refuse, before anything is read or written, an --out whose contents a run would destroy: the source
    model folder itself or a folder inside it, a file, a model folder or other files that qkv finetune did
    not write, another recipe's output, or this recipe's run with checkpoints when --resume is not given.
    What is left is a new or empty folder, or this recipe's own output (continued with --resume, else
    written over). Under torchrun rank 0 alone checks: a slower rank would find what rank 0 has begun to
    write, and a refusal on rank 0 stops every rank."""
    if launched_by_torchrun() and os.environ["RANK"] != "0":
        return
    out, source = Path(out), Path(source)
    where, src = out.resolve(), source.resolve()
    if where == src:
        raise ConfigError(f"--out {out} already holds a model folder: the source model being fine-tuned; "
                          "choose another --out")
    if src in where.parents:
        raise ConfigError(f"--out {out} lies inside the source model folder {source}; choose another --out")
    check_out_folder(out)
    # .gitkeep, .DS_Store
    if not out.exists() or not any(p for p in out.iterdir() if not p.name.startswith(".")):
        return
    owner = written_by(out)
    if owner is None and resume and latest_checkpoint(out / "checkpoints") is not None:
        return  # a run of a qkv finetune from before finetune.json marked its folders: --resume continues it
    if owner is None:
        if (out / "config.json").is_file():
            raise ConfigError(f"--out {out} already holds a model folder that qkv finetune did not write; "
                              "choose another --out")
        names = sorted(p.name for p in out.iterdir())
        raise ConfigError(f"--out {out} already holds other files ({', '.join(names[:3])}"
                          f"{', ...' if len(names) > 3 else ''}); choose a new or empty folder")
    if owner != recipe:
        raise ConfigError(f"--out {out} already holds the output of qkv finetune --task {owner}; choose "
                          "another --out")
    if latest_checkpoint(out / "checkpoints") is not None and not resume:
        raise ConfigError(f"--out {out} already holds a fine-tuning run; pass --resume to continue it or "
                          "choose another --out")


def mark_out(out: str | Path, recipe: str) -> None:
    """Write OUT/finetune.json naming the recipe (rank 0 only), before training starts: it is what check_out
    recognises a run by, so an interrupted run can be resumed. The recipe rewrites the file with its results
    at the end."""
    out = Path(out)
    # a resumed run keeps the settings it recorded
    if (launched_by_torchrun() and os.environ["RANK"] != "0") or written_by(out) == recipe:
        return
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json({"recipe": recipe}, out / FINETUNE_FILE)


__all__ = ["FINETUNE_FILE", "check_out", "mark_out", "written_by"]
