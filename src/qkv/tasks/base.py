"""The Task interface, the task registry and `build_task`.

A Task is a *batch source* (`batch(index, batch_size, split) -> dict[str, Tensor]`, deterministic in
(seed, split, index), so the trainer needs no sampler state to resume or shard) plus what is needed to
build a model for it and judge it: `tokenizer`, `model_overrides()`, `evaluate(model, n)`,
`samples(model, n)`. The batch layout depends on the model's KIND (models.registry.KINDS: decoder,
seq2seq, encoder, image, audio, dual), never on a family name: a task says which kinds it serves, a family
which kinds it is, and `build_task("reverse", family="gpt", ...)` takes the first kind they share. A new
family of a known kind therefore trains on every task of that kind unchanged. `model_overrides()` are the
task's needs in shared names (vocab_size, context_length, num_labels, special ids, ...); the family turns
them into its config fields (`config_for_task`).

A task is rebuilt exactly from `task.to_dict()` ({"task", "family", "options"}) plus its saved tokenizer:
`task.save(folder)` writes task.json + tokenizer.json; `load_task(folder)` reads them back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.config import ConfigError, from_dict, suggest, to_dict
from qkv.extras import require
from qkv.models.registry import config_for, families
from qkv.models.registry import family as family_spec
from qkv.storage import atomic_write_json
from qkv.tasks.options import SECTION
from qkv.tasks.tokenizers import Tokenizer, TokenizerError, load_tokenizer, save_tokenizer

TASK_FILE = "task.json"
SPLITS = ("train", "val")


def rng_for(seed: int, split: str, index: int, salt: str = "") -> random.Random:
    """An independent, reproducible stream per (seed, split, index): random.Random seeds from a string
    through SHA-512, identical on every platform and Python run (unlike hash())."""
    return random.Random(f"qkv/{salt}/{seed}/{split}/{index}")


def in_val_split(key: str, val_fraction: float) -> bool:
    """Hash split of an example space: an example belongs to the held-out split iff the hash of its key
    (the source string) falls in the first `val_fraction` of the range. Train and val can never share a
    source, however small the space, and the split does not depend on the seed."""
    h = int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little")
    return h % 1_000_000 < val_fraction * 1_000_000


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")


def pad_rows(rows: Sequence[Sequence[int]], value: int, length: int | None = None,
             left: bool = False) -> Tensor:
    """(B, T) long tensor from ragged rows, padded with `value` on the right (or left)."""
    T = length if length is not None else max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), T), value, dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            if left:
                out[i, T - len(r):] = torch.as_tensor(r, dtype=torch.long)
            else:
                out[i, :len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out


def model_device(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def kind_for(task: str, kinds: Sequence[str], family: str) -> str:
    """The kind a task of `kinds` takes with model `family`: the first of the family's kinds it serves."""
    fam = family_spec(family)
    for k in fam.kinds:
        if k in kinds:
            return k
    serving = [f for f in families() if any(k in kinds for k in family_spec(f).kinds)]
    raise ConfigError(f"task {task!r} supports model families of kind {list(kinds)} ({', '.join(serving)}), "
                      f"not {family!r} (a {' / '.join(fam.kinds)} model)")


class Task:
    """Base class. Subclasses set `name`, `kinds`, `options`, `tokenizer`, `family` and implement `batch`,
    `model_overrides`, `evaluate` and `samples`; they branch on `self.kind`."""

    name: str = ""
    kinds: tuple[str, ...] = ()  # the kinds of model this task serves (models.registry.KINDS)
    options: Any
    tokenizer: Tokenizer
    family: str
    # the scores evaluate() reports, each with its direction ("max" = higher is better); the first is the
    # primary one: the default train.best_metric (checkpoints/best) and what a run is judged by
    metrics: dict[str, str] = {}
    # SHA-256 of the user's data file the task was built from (None: a built-in corpus or dataset), recorded
    # in task.json: a run rebuilt on a file that changed since (same characters, other text) must not train or
    # evaluate on it as if it were the run's data (check_recorded_data)
    data_sha256: str | None = None
    missing: str | None = None  # why batches and evaluation are refused (the data is gone or changed)

    @classmethod
    def primary_metric(cls) -> str:
        return next(iter(cls.metrics))

    @property
    def kind(self) -> str:
        """The kind of model this task was built for (from its family)."""
        if getattr(self, "_kind", None) is None:
            self._kind = kind_for(self.name or type(self).__name__, self.kinds, self.family)
        return self._kind

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, Tensor]:
        raise NotImplementedError

    def model_overrides(self, family: str | None = None) -> dict[str, Any]:
        """What a model needs to fit this task's batches, in shared names (see config_overrides)."""
        raise NotImplementedError

    def config_overrides(self) -> dict[str, Any]:
        """model_overrides() in the config fields of this task's family (its `config_for_task`)."""
        return family_spec(self.family).model_class.config_for_task(self.kind, self.model_overrides())

    def evaluate(self, model: torch.nn.Module, n: int = 500, batch_size: int = 128) -> dict[str, float]:
        raise NotImplementedError

    def samples(self, model: torch.nn.Module, n: int = 5) -> list[str]:
        raise NotImplementedError

    def generate_text(self, model: torch.nn.Module, prompt: str, **kwargs: Any) -> str:
        """What `qkv generate` prints for a user prompt: a translation (seq2seq), a continuation (LM),
        a predicted class (classification)."""
        raise NotImplementedError

    # -- helpers shared by every task ---------------------------------------------------------------
    def _check_family(self, family: str | None) -> str:
        family = family or self.family
        if family != self.family:
            raise ConfigError(f"task {self.name!r} was built for family {self.family!r}, its batches do not "
                              f"fit {family!r}; build it with family={family!r}")
        return family

    def build_model(self, preset_or_config: Any, **overrides: Any) -> Any:
        """A fresh model for this task: a preset name (or config) with this task's vocabulary, context
        and special-token ids applied (in its family's fields), then `overrides`."""
        fam, _ = config_for(preset_or_config)
        if fam.name != self.family:
            raise ConfigError(f"model {preset_or_config!r} is a {fam.name} model, but task {self.name!r} was "
                              f"built for family {self.family!r}")
        return fam.model_class(config_for(preset_or_config, **{**self.config_overrides(), **overrides})[1])

    def to_dict(self) -> dict[str, Any]:
        """{"task": name, "family": family, "options": {...}} (and "data_sha256" for a user's data file): with
        the saved tokenizer, rebuilds this task."""
        out = {"task": self.name, "family": self.family, "options": to_dict(self.options)}
        if self.data_sha256 is not None:
            out["data_sha256"] = self.data_sha256
        return out

    def save(self, folder: str | os.PathLike) -> Path:
        """Write task.json and the tokenizer (tokenizer.json + tokenizer_config.json) into `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.to_dict(), folder / TASK_FILE)
        if getattr(self, "tokenizer", None) is not None:  # image classification tasks have none
            save_tokenizer(self.tokenizer, folder)
        return folder / TASK_FILE

    def __repr__(self) -> str:
        return f"{type(self).__name__}(family={self.family!r}, {self.options})"


def text_lines(text: str) -> list[str]:
    """The lines of a data file's text: split at "\n" only (a "\r" before it dropped), as `wc -l`, a file's
    iteration and JSON Lines count them. str.splitlines also splits at form feeds, U+2028, NEL and other
    characters that may sit inside a line (raw U+2028 is valid inside a JSON string), which would cut a record
    in two and shift every later line number."""
    lines = [ln[:-1] if ln.endswith("\r") else ln for ln in text.split("\n")]
    if lines and lines[-1] == "":  # the newline that ends the last line
        lines.pop()
    return lines


def text_sha256(text: str) -> str:
    """The digest task.json records of a data file's text (Task.data_sha256)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_recorded_data(task: Task, recorded: str | None) -> None:
    """A task rebuilt from a run (task.json's data_sha256 = `recorded`) on a data file whose text changed
    since:
    batches and evaluation are refused (task.missing), as for a file that is gone; generation still works (it
    needs only the saved tokenizer). Runs saved before digests were recorded are not checked."""
    if recorded is None or task.missing or task.data_sha256 in (None, recorded):
        return
    path = getattr(task.options, "path", None)
    task.missing = (f"{path}: the file changed since the run was trained (its SHA-256 is not the one the "
                    "run's task.json records); train a new run on it (another --out), or restore the file")


def recorded_data_sha256(folder: str | os.PathLike) -> str | None:
    """The data digest a run folder's task.json records (None: none recorded, or no readable task.json)."""
    try:
        data = json.loads((Path(folder) / TASK_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    digest = data.get("data_sha256") if isinstance(data, dict) else None
    return digest if isinstance(digest, str) else None


def read_text_file(path: str | os.PathLike, what: str = "text file") -> str:
    """A UTF-8 text file's contents; a clear ConfigError when it is missing, not a file, not UTF-8, or
    empty."""
    p = Path(path).expanduser()  # task.path=~/book.txt: the shell does not expand ~ after "key="
    if not p.exists():
        raise ConfigError(f"{what} not found: {p}")
    if not p.is_file():
        raise ConfigError(f"not a file: {p}")
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark (Excel, Notepad) is not text
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise ConfigError(f"{what} is empty: {p}")
    return text


# -- registry -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TaskSpec:
    name: str
    options_class: type
    factory: Callable[..., Task]  # factory(options, family, tokenizer=None) -> Task
    kinds: tuple[str, ...]  # the kinds of model the task serves
    default_family: str  # the family built when none is named
    description: str
    # per-name defaults (charlm/bpelm)
    option_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    # optional packages (import names, see qkv.extras), checked before building
    requires: tuple[str, ...] = ()


_TASKS: dict[str, TaskSpec] = {}


def register_task(name: str, options_class: type, factory: Callable[..., Task], kinds: Sequence[str],
                  description: str, *, default_family: str, requires: Sequence[str] = (),
                  **option_defaults: Any) -> None:
    _TASKS[name] = TaskSpec(name, options_class, factory, tuple(kinds), default_family, description,
                            option_defaults, tuple(requires))


def task_names() -> list[str]:
    return sorted(_TASKS)


def task_spec(name: str) -> TaskSpec:
    if name not in _TASKS:
        raise ConfigError("unknown task "
                          f"{name!r}{suggest(name, list(_TASKS), 'known tasks')}")
    return _TASKS[name]


def build_options(name: str, options: dict[str, Any] | None = None) -> Any:
    """The strict options dataclass of task `name` (unknown keys -> ConfigError naming the closest)."""
    spec = task_spec(name)
    return from_dict(spec.options_class, {**spec.option_defaults, **(options or {})}, SECTION)


def build_task(name: str, family: str | None = None, *, saved_tokenizer: Tokenizer | None = None,
               **options: Any) -> Task:
    """Build task `name` for model `family` (default: the task's default family) with `options`; the
    family must be of a kind the task serves.
    Pass `saved_tokenizer` (e.g. load_tokenizer(checkpoint)) to reuse a saved vocabulary exactly (the
    option `tokenizer=char|bpe` of the LM/TSV tasks only says which kind to build; a Tokenizer object
    passed as `tokenizer=` is taken as `saved_tokenizer`)."""
    if isinstance(options.get("tokenizer"), Tokenizer):  # a tokenizer object, not the char|bpe option
        saved_tokenizer = options.pop("tokenizer")
    spec = task_spec(name)
    for module in spec.requires:  # a missing optional package: one clear error before any work
        require(module, f"task {name!r}")
    family = family or spec.default_family
    kind = kind_for(name, spec.kinds, family)
    opts = build_options(name, options)
    task = spec.factory(opts, family, tokenizer=saved_tokenizer)
    task.name, task.kinds, task._kind = name, spec.kinds, kind
    return task


def task_from_dict(data: dict[str, Any], tokenizer: Tokenizer | None = None) -> Task:
    """Inverse of Task.to_dict()."""
    if not isinstance(data, dict) or "task" not in data:
        raise ConfigError("a task description needs a 'task' key (and optionally 'family', 'options')")
    unknown = set(data) - {"task", "family", "options", "data_sha256"}
    if unknown:
        raise ConfigError(f"unknown key {sorted(unknown)[0]!r} in task description; valid keys: data_sha256, "
                          "family, options, task")
    task = build_task(data["task"], data.get("family"), saved_tokenizer=tokenizer,
                      **(data.get("options") or {}))
    check_recorded_data(task, data.get("data_sha256"))
    return task


def load_task(folder: str | os.PathLike) -> Task:
    """Rebuild the task saved by `Task.save(folder)`, with its saved tokenizer."""
    folder = Path(folder)
    path = folder / TASK_FILE
    if not path.is_file():
        raise ConfigError(f"no {TASK_FILE} in {folder}: this run folder does not record its task")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    try:
        tok = load_tokenizer(folder)
    except TokenizerError:
        tok = None  # rebuilt from the options (deterministic for every tokenizer kind)
    return task_from_dict(data, tokenizer=tok)
