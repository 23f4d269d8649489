"""What the explorer holds about a loaded model, and the error it shows on the page: the floor that
adapter.py (models, tasks, caches) and media.py (images, audio) both stand on."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


class ExploreError(ValueError):
    """A user error (bad input, unsupported model): shown on the page, answered with HTTP 400."""


@dataclass
class Loaded:
    """A model ready to explore: the module, how to turn input into tokens, and what kind it is."""

    model: torch.nn.Module
    name: str
    family: str
    kind: str  # decoder | seq2seq | encoder | image | audio
    tokenizer: Any = None  # None: the input is whitespace-separated token ids
    task: Any = None  # the run's task when MODEL is a run folder
    folder: Path | None = None
    vision: Any = None  # a vision-language model: (its chat tokenizer, its ImageProcessor)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one request at a time uses the model


def config(ld: Loaded) -> Any:
    """The model's config (a vision-language model's: its language model's; the page shows that)."""
    return ld.model.config.text if ld.vision is not None else ld.model.config
