"""A run = a model, a task and training settings, from one YAML file plus dotted overrides.

    model: {preset: transformer-tiny, n_heads: 8}     # a preset (or family: ...) + config overrides
    task:  {name: reverse, min_len: 10, max_len: 20}  # a task name + its options
    train: {max_steps: 600, lr: 1e-3, ...}            # qkv.train.TrainConfig fields
    eval:  {n: 1000, samples: 5}                      # final held-out evaluation

The CLI (`qkv train/eval/generate/info/attention`) and the demo are thin layers over these functions.
A run folder holds run.yaml, task.json + tokenizer, metrics.jsonl/csv, curves.png, checkpoints/ and
results.json; `load_model_any` and `load_run_task` rebuild the model and the task from it alone.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml

from qkv.config import ConfigError, _closest, apply_overrides, from_dict, load_yaml, parse_overrides

SECTIONS = ("model", "task", "train", "eval")
RUN_FILE = "run.yaml"
RESULTS_FILE = "results.json"


@dataclass
class EvalSettings:
    n: int = 500  # held-out examples in the final evaluation
    samples: int = 3  # sample outputs printed at the end
    during_training: int = 0  # held-out examples evaluated every train.eval_every steps (0 = final only)


def config_path(name_or_path: str) -> Path:
    """A YAML path, or the name of a shipped config (`reverse` -> configs/reverse.yaml)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    if p.suffix in (".yaml", ".yml") and (p.parent != Path(".") or os.sep in name_or_path):
        raise ConfigError(f"config file not found: {p}")
    shipped = resources.files("qkv") / "configs"
    for cand in (f"{name_or_path}", f"{name_or_path}.yaml"):
        f = shipped / cand
        if f.is_file():
            return Path(str(f))
    names = sorted(x.name[:-5] for x in shipped.iterdir() if x.name.endswith(".yaml")) if shipped.is_dir() else []
    raise ConfigError(f"config file not found: {name_or_path}" + (_closest(name_or_path, names).replace(
        "valid keys", "shipped configs") if names else ""))


def load_run_config(path: str | None, overrides: list[str] | None = None) -> dict[str, Any]:
    """Read a run YAML (or start empty) and apply `section.key=value` overrides; sections are checked."""
    data = load_yaml(config_path(path)) if path else {}
    data = apply_overrides(data, parse_overrides(overrides or []), "run config")
    for key in data:
        if key not in SECTIONS:
            raise ConfigError(f"unknown section {key!r} in run config{_closest(key, list(SECTIONS))}")
        if not isinstance(data[key], dict):
            raise ConfigError(f"run config section {key!r} must be a mapping")
    return data


def prepare(cfg: dict[str, Any], out_dir: str | Path | None = None):
    """(task, model, TrainConfig, EvalSettings) for a run config."""
    from qkv.models.registry import config_for
    from qkv.tasks import build_task
    from qkv.train import TrainConfig
    from qkv.train.rng import seed_everything

    model_sec = dict(cfg.get("model") or {})
    task_sec = dict(cfg.get("task") or {})
    if "preset" not in model_sec and "family" not in model_sec:
        raise ConfigError("no model given: pass --model PRESET (see `qkv presets`) or model.preset=...")
    if "name" not in task_sec:
        raise ConfigError("no task given: pass --task NAME or task.name=...")
    train = dict(cfg.get("train") or {})
    if out_dir is not None:
        train["out_dir"] = str(out_dir)
    train_cfg = from_dict(TrainConfig, train)
    ev = from_dict(EvalSettings, dict(cfg.get("eval") or {}))
    fam, _ = config_for({k: v for k, v in model_sec.items() if k in ("preset", "family")})
    # seed before anything random is drawn: the model's initial weights (and any randomness in building the
    # task) depend on train.seed alone, so one seed gives the same run in a new process
    seed_everything(train_cfg.seed)
    task = build_task(task_sec.pop("name"), family=fam.name, **task_sec)
    model = task.build_model({k: v for k, v in model_sec.items() if k in ("preset", "family")},
                             **{k: v for k, v in model_sec.items() if k not in ("preset", "family")})
    return task, model, train_cfg, ev


def default_out(cfg: dict[str, Any]) -> Path:
    m = cfg.get("model") or {}
    return Path("runs") / f"{(cfg.get('task') or {}).get('name', 'task')}-{m.get('preset', m.get('family', 'model'))}"


def _write_yaml(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(obj, sort_keys=False), encoding="utf-8")
    os.replace(tmp, path)


def train_run(cfg: dict[str, Any], out: str | Path | None = None, resume: bool = False,
              quiet: bool = False) -> dict[str, Any]:
    """Train, evaluate on the held-out split, write results.json; returns a summary with a printable report."""
    from qkv.train import Trainer, latest_checkpoint

    out = Path(out) if out else default_out(cfg)
    has_ckpt = latest_checkpoint(out / "checkpoints") is not None
    if has_ckpt and not resume:
        raise ConfigError(f"{out} already holds a trained run; pass --resume to continue it or choose another --out")
    if resume and (out / RUN_FILE).is_file():
        saved = load_yaml(out / RUN_FILE)
        for section, values in cfg.items():  # the command line may extend a saved run (e.g. more steps)
            saved.setdefault(section, {}).update(values)
        cfg = saved
    task, model, train_cfg, ev = prepare(cfg, out)
    out.mkdir(parents=True, exist_ok=True)
    if int(os.environ.get("RANK", "0")) == 0:
        _write_yaml(cfg, out / RUN_FILE)
        task.save(out)
    eval_fn = (lambda m: task.evaluate(m, n=ev.during_training)) if ev.during_training else None
    trainer = Trainer(model, train_cfg, task, eval_fn=eval_fn, resume=resume and has_ckpt)
    summary = trainer.fit()
    model = trainer.model
    if not trainer.dist.is_main:  # under torchrun only rank 0 evaluates and writes results
        trainer.close()
        return {"out": out, "metrics": {}, "samples": [], "train": summary, "report": ""}
    trainer.close()
    metrics = task.evaluate(model, n=ev.n)
    samples = task.samples(model, ev.samples) if ev.samples else []
    result = {"metrics": metrics, "samples": samples, "train": _jsonable(summary),
              "parameters": model.num_parameters() if hasattr(model, "num_parameters") else None}
    tmp = out / f".{RESULTS_FILE}.tmp"
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, out / RESULTS_FILE)
    lines = [f"run folder: {out}", f"held-out ({ev.n} examples): " + ", ".join(
        f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())]
    lines += ["samples:"] + [f"  {s}" for s in samples]
    ck = latest_checkpoint(out / "checkpoints")
    lines += [f"checkpoint: {ck}", f"metrics: {out / 'metrics.jsonl'}", f"plot: {out / 'curves.png'}"]
    return {"out": out, "metrics": metrics, "samples": samples, "train": summary, "report": "\n".join(lines)}


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def _model_folder(path: Path) -> Path:
    """A folder holding config.json: the path itself, or a run folder's best/newest checkpoint."""
    from qkv.train import latest_checkpoint

    if (path / "config.json").is_file():
        return path
    ck = latest_checkpoint(path / "checkpoints")
    if ck is not None:
        return ck
    from qkv.checkpoint import CheckpointError

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


def load_model_any(path: str | Path) -> torch.nn.Module:
    """A model from a run folder, a qkv checkpoint folder, or a Hugging Face-format folder."""
    from qkv import from_pretrained

    return from_pretrained(_model_folder(Path(path)))


def load_run_task(path: str | Path):
    from qkv.tasks import load_task

    run = run_folder_of(path)
    if run is None:
        raise ConfigError(f"{path} is not inside a qkv run folder (no task.json): it records no task")
    return load_task(run)


def evaluate_run(path: str | Path, n: int = 500) -> dict[str, Any]:
    model, task = load_model_any(path), load_run_task(path)
    model.eval()
    return task.evaluate(model, n=n)


def generate_text(path: str | Path, prompt: str, *, max_new_tokens: int = 200, temperature: float = 1.0,
                  top_k: int | None = None, top_p: float | None = None, num_beams: int = 1, greedy: bool = False,
                  seed: int = 0, stream: bool = False) -> str:
    """Decode with whatever the library has: the run's task decides what a prompt means (a source
    sentence for seq2seq, a text prefix for an LM); a Hugging Face folder needs its tokenizer.json."""
    torch.manual_seed(seed)
    model = load_model_any(path)
    model.eval()
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
              num_beams=num_beams, do_sample=not greedy and num_beams == 1)
    run = run_folder_of(path)
    if run is not None:
        task = load_run_task(run)
        if stream and getattr(task, "family", None) == "gpt" and hasattr(task, "chars_per_token"):
            return _stream_lm(model, task.tokenizer, prompt, kw, seed)
        text = task.generate_text(model, prompt, **kw)
        if stream:
            print(text)
        return text
    tok = _folder_tokenizer(_model_folder(Path(path)))
    ids = torch.tensor([_encode(tok, prompt) or [0]])
    out = model.generate(ids, **kw)
    text = _decode(tok, out[0, ids.shape[1]:].tolist())
    if stream:
        print(prompt + text)
    return prompt + text


def _stream_lm(model: torch.nn.Module, tok: Any, prompt: str, kw: dict[str, Any], seed: int) -> str:
    """Print a language model's continuation token by token as it is produced (qkv.generate.stream)."""
    from qkv.generate import stream

    ids = _encode(tok, prompt) or [getattr(tok, "eos_id", 0)]
    kw = {k: v for k, v in kw.items() if k != "num_beams"}
    print(prompt, end="", flush=True)
    pieces = []
    x = torch.tensor([ids])
    for new in stream(model, x, context_overflow="slide", generator=torch.Generator().manual_seed(seed), **kw):
        piece = _decode(tok, new.tolist())
        print(piece, end="", flush=True)
        pieces.append(piece)
    print()
    return prompt + "".join(pieces)


def attention_report(path: str | Path, text: str, out_png: Path, target: str | None = None) -> list[str]:
    """Attention maps of every layer x head for `text` (PNG grids) and the per-head entropy table."""
    from qkv.experiments import attention_from_checkpoint

    model = load_model_any(path)
    if getattr(model, "family", "") == "vit":
        return _vit_overlay(model, path, text, out_png)
    res = attention_from_checkpoint(_model_folder(Path(path)), text, out_png, target=target)
    return [f"wrote {p}" for p in res.pngs] + [res.entropy_table()]


def _vit_overlay(model: torch.nn.Module, path: str | Path, text: str, out_png: Path) -> list[str]:
    """ViT: attention of the last layer over the patches, drawn on the first N held-out images of the run's
    task (`--input N`, default 8), titled with predicted / true class."""
    from qkv.models.vit import save_attention_overlay

    try:
        n = int(text) if text.strip() else 8
    except ValueError:
        raise ConfigError("for a ViT, --input is the number of held-out images to show (e.g. --input 8)") from None
    task = load_run_task(path)
    batch = task.batch(0, max(1, min(n, 32)), "val")
    model.eval()
    with torch.no_grad():
        pred = model(pixel_values=batch["pixel_values"]).logits.argmax(-1)
    classes = getattr(task, "classes", None)
    names = [classes[int(i)] if classes else str(int(i)) for i in pred]
    truth = [classes[int(i)] if classes else str(int(i)) for i in batch["labels"]]
    save_attention_overlay(model, batch["pixel_values"], str(out_png),
                           titles=[f"pred {p} / true {t}" for p, t in zip(names, truth)])
    return [f"wrote {out_png}"]


def _folder_tokenizer(folder: Path):
    from qkv.tasks.tokenizers import find_tokenizer

    tok = find_tokenizer(folder)
    if tok is None:
        raise ConfigError(f"{folder} has no task.json and no tokenizer: cannot turn text into tokens")
    return tok


def _encode(tok: Any, text: str) -> list[int]:
    enc = tok.encode(text)
    return list(enc.ids) if hasattr(enc, "ids") else list(enc)


def _decode(tok: Any, ids: list[int]) -> str:
    return tok.decode(ids)


__all__ = ["EvalSettings", "attention_report", "evaluate_run", "generate_text", "load_model_any",
           "load_run_config", "load_run_task", "prepare", "train_run"]
