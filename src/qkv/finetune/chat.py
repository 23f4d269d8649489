"""The `chat` recipe: instruction fine-tuning of a decoder model on conversations, the loss on what the
assistant says and nothing else.

    qkv finetune DIR --data chats.jsonl --out OUT [--dev dev.jsonl] [--lora [--lora-rank 8 ...]]
                 [--max-length N] [--too-long error|skip] [--epochs E] [train.key=value ...]

Data: one JSON object per line, either
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
    {"prompt": "...", "completion": "..."}          (optionally "system": "...")
Each conversation is rendered with the model folder's own chat template (so the fine-tuned model is prompted
exactly as `qkv chat` will prompt it) and tokenized; labels are the token ids on the assistant's tokens (its
content and the end-of-turn token after it, so the model learns to stop) and -100 everywhere else: the system
prompt, the user's turns and the template's role markers add nothing to the loss. A folder without a chat
template gets `qkv chat`'s plain transcript ("User: ...\nAssistant: ..."), each answer followed by eos, with a note.

Batches: one conversation per row, right-padded to the longest row of the batch, rows of similar length
grouped (within windows of shuffled data) so little is padding. Not packed: packing several conversations into
one row would let their tokens attend to each other (the model's mask is causal, not block-diagonal) and
continue positions across them; right padding needs no mask at all, since causal attention never lets a real
token see the pads after it, so the fused causal kernel still runs.

Training is qkv.train.Trainer's (schedules, clipping, bf16, checkpoints in OUT/checkpoints, exact resume with
--resume, DDP/FSDP under torchrun). OUT ends as a model folder: the weights (LoRA merged in), config, the
source folder's tokenizer and chat template: `qkv generate OUT`, `qkv chat OUT` and transformers load it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.config import ConfigError, from_dict, parse_overrides
from qkv.finetune import (
    FINETUNE_FILE,
    Recipe,
    epoch_updates,
    epochs_to_steps,
    read_data_text,
    register_recipe,
    shared,
)
from qkv.finetune.chat_output import (  # noqa: F401  (EXPORTERS, TOKENIZER_FILES: part of this recipe's API)
    EXPORTERS,
    TOKENIZER_FILES,
    best_checkpoint,
    check_exportable,
    final_model,
    save_model_folder,
    weights_lines,
)

ROLES = ("system", "user", "assistant")
FEW_STEPS = 50  # fewer optimizer steps than this, set by --epochs rather than train.max_steps: a warning
IGNORE = -100


# -- reading the data --------------------------------------------------------------------------------------
def _messages(obj: Any, where: str) -> list[dict[str, str]]:
    """The conversation of one JSONL record, checked; errors name `where` (file:line)."""
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object with 'messages' (or 'prompt'/'completion'), "
                          f"got a JSON {type(obj).__name__}")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ConfigError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ConfigError(f"{where}: message {i} must be an object with 'role' and 'content'")
            if m["role"] not in ROLES:
                raise ConfigError(f"{where}: message {i} has unknown role {m['role']!r} "
                                  f"(expected one of {', '.join(ROLES)})")
            if not isinstance(m["content"], str):
                raise ConfigError(f"{where}: message {i}: 'content' must be a string")
            out.append({"role": m["role"], "content": m["content"]})
    elif "prompt" in obj or "completion" in obj:
        if not isinstance(obj.get("prompt"), str) or not isinstance(obj.get("completion"), str):
            raise ConfigError(f"{where}: a prompt/completion record needs both as strings")
        out = [{"role": "user", "content": obj["prompt"]}, {"role": "assistant", "content": obj["completion"]}]
        if obj.get("system") is not None:
            if not isinstance(obj["system"], str):
                raise ConfigError(f"{where}: 'system' must be a string")
            out.insert(0, {"role": "system", "content": obj["system"]})
    else:
        raise ConfigError(f"{where}: missing 'messages' (or 'prompt' and 'completion'); the record has "
                          f"{', '.join(map(repr, obj)) or 'no keys'}")
    if not any(m["role"] == "assistant" and m["content"] for m in out):
        raise ConfigError(f"{where}: no assistant message with content: nothing to learn from this record")
    return out


def read_chats(path: str | Path) -> list[tuple[int, list[dict[str, str]]]]:
    """[(line number, messages)] of a JSONL file. Blank lines are skipped; anything else that is not a valid
    record is one ConfigError naming the file and line."""
    path = Path(path)
    text = read_data_text(path, "{path}:{line}")  # a byte order mark dropped; not UTF-8: file:line
    if not text.strip():
        raise ConfigError(f"{path}: the file is empty (expected one JSON object per line)")
    out = []
    for n, line in enumerate(text.split("\n"), 1):  # at "\n" only, as wc -l counts (see tasks.base.text_lines)
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: invalid JSON ({e.msg} at column {e.colno})") from None
        out.append((n, _messages(obj, f"{path}:{n}")))
    return out


# -- rendering and labels ---------------------------------------------------------------------------------
@dataclass
class Example:
    line: int
    input_ids: list[int]
    labels: list[int]  # IGNORE outside the assistant's tokens


def encode_chat(tok: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(ids, labels) of one conversation: rendered with the folder's chat template, labels = ids on the
    assistant's tokens (the template's assistant mask) and IGNORE elsewhere. Without a template: the plain
    concatenation (see the module docstring)."""
    if tok.has_chat_template:
        ids, mask = tok.apply_chat_template(messages, return_assistant_mask=True)
        return list(ids), [i if m else IGNORE for i, m in zip(ids, mask)]
    return _plain(tok, messages)


def _plain(tok: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """The plain transcript `qkv chat` uses for a folder without a template ("system\n\nUser: ...\nAssistant:
    ..."), with the eos token written after each answer; the loss on " answer<eos>". Tokenized as one text
    (as qkv chat tokenizes it), the answers located by character offsets."""
    from qkv.chat import plain_transcript
    from qkv.interop.tokenizer import spans_to_token_mask

    if tok.eos_token is None:
        raise ConfigError("the model folder has no chat template and no eos token: cannot mark where an answer "
                          "ends")
    text, spans = plain_transcript(messages, tok.eos_token, reply=False)
    ids, offsets = tok.encode_with_offsets(text, add_special_tokens=True)  # as qkv chat encodes its prompt
    mask = spans_to_token_mask(spans, offsets)
    return ids, [i if m else IGNORE for i, m in zip(ids, mask)]


def build_examples(tok: Any, records: list[tuple[int, list[dict[str, str]]]], max_length: int, path: str,
                   too_long: str) -> tuple[list[Example], list[int]]:
    """Examples of the records; records over max_length tokens are an error (too_long="error") or skipped
    and listed (too_long="skip"). Returns (examples, skipped line numbers)."""
    out, skipped = [], []
    for line, msgs in records:
        try:
            ids, labels = encode_chat(tok, msgs)
        except ValueError as e:  # the template refused the conversation (raise_exception), or lost the answer
            raise ConfigError(f"{path}:{line}: {str(e).splitlines()[0]}") from None
        if len(ids) > max_length:
            if too_long == "skip":
                skipped.append(line)
                continue
            raise ConfigError(f"{path}:{line}: the conversation is {len(ids)} tokens, longer than the context of "
                              f"{max_length} (--max-length); shorten it, or pass --too-long skip to leave such "
                              "records out")
        if all(x == IGNORE for x in labels[1:]):  # the model predicts labels[1:] (position 0 has no history)
            raise ConfigError(f"{path}:{line}: no assistant token to learn after rendering")
        out.append(Example(line, ids, labels))
    return out, skipped


# -- the batch source ---------------------------------------------------------------------------------------
class ChatData:
    """Trainer batch source: `batch(index, batch_size, split)` is a pure function of its arguments (the seed
    and the data), which is what makes --resume exact. Epoch e visits the examples in a permutation seeded by
    (seed, e); within windows of `window` batches the rows are sorted by length, so a batch holds rows of
    similar length; the batches of an epoch are then shuffled again."""

    metrics = {"loss": "min"}

    def __init__(self, train: list[Example], dev: list[Example], pad_id: int, seed: int = 0, window: int = 16):
        if not train:
            raise ConfigError("no training examples left")
        self.train, self.dev, self.pad_id, self.seed, self.window = train, dev, pad_id, seed, window
        self._epochs: dict[tuple[int, int], list[list[int]]] = {}

    def _epoch(self, epoch: int, bs: int) -> list[list[int]]:
        key = (epoch, bs)
        if key not in self._epochs:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(len(self.train), generator=g).tolist()
            batches = []
            span = bs * self.window
            for s in range(0, len(order), span):
                chunk = sorted(order[s:s + span], key=lambda i: -len(self.train[i].input_ids))
                batches += [chunk[j:j + bs] for j in range(0, len(chunk), bs)]
            perm = torch.randperm(len(batches), generator=g).tolist()
            self._epochs = {key: [batches[i] for i in perm]}  # one epoch at a time is all a run needs
        return self._epochs[key]

    def batches_per_epoch(self, bs: int) -> int:
        return -(-len(self.train) // bs)

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, Tensor]:
        if split == "train":
            n = self.batches_per_epoch(batch_size)
            rows = [self.train[i] for i in self._epoch(index // n, batch_size)[index % n]]
        else:
            if not self.dev:
                raise ConfigError("no held-out data: pass --dev FILE")
            start = (index * batch_size) % len(self.dev)
            rows = self.dev[start:start + batch_size]
        return collate(rows, self.pad_id)


def collate(rows: list[Example], pad_id: int) -> dict[str, Tensor]:
    """Right-padded input_ids and labels (IGNORE on the padding); no attention mask (see the module docstring)."""
    T = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r.input_ids)] = torch.tensor(r.input_ids)
        labels[b, : len(r.labels)] = torch.tensor(r.labels)
    return {"input_ids": ids, "labels": labels}


# -- the recipe ----------------------------------------------------------------------------------------------
def add_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--lora", action="store_true", help="train LoRA adapters instead of every weight (merged on save)")
    g.add_argument("--lora-rank", type=int, default=8, help="LoRA rank r (default 8)")
    g.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA alpha; the update is scaled by alpha/r (16)")
    g.add_argument("--lora-dropout", type=float, default=0.05, help="dropout on the adapters' input (0.05)")
    g.add_argument("--lora-targets", default="q,v",
                   help="layers to adapt, comma separated: q,k,v (slices of the fused attention projection), "
                        "out_proj, up, gate, down, Hugging Face names (q_proj, o_proj, ...), globs, or all-linear "
                        "(default q,v)")
    g.add_argument("--export", choices=("best", "last"), default="best",
                   help="the weights OUT holds: the best dev loss's checkpoint when --dev was evaluated more than "
                        "once (best, the default), or the last step's (last)")
    g.add_argument("--max-length", type=int, default=None,
                   help="longest conversation in tokens (default and upper bound: the longest sequence the model "
                        "accepts, its context length or a shorter sliding window)")


def _tokenizer(folder: Path) -> Any:
    from qkv.interop.tokenizer import load_hf_tokenizer

    return load_hf_tokenizer(folder)


def _train_config(args: argparse.Namespace, n_train: int, n_dev: int, lora: bool) -> Any:
    """TrainConfig: fine-tuning defaults, then the command line's train.key=value."""
    from qkv.train import TrainConfig

    over = parse_overrides(list(args.overrides or []))
    bad = [k for k in over if not k.startswith("train.")]
    if bad:
        raise ConfigError(f"qkv finetune takes Trainer settings as train.key=value; {bad[0]!r} is not one")
    train = {k[len("train."):]: v for k, v in over.items()}
    cfg: dict[str, Any] = {
        # the usual instruction-tuning settings: a small LR for full fine-tuning, ten times that for LoRA
        # (its update starts at zero and is scaled by alpha/r), no weight decay, short warmup, cosine decay
        "lr": 2e-4 if lora else 2e-5, "weight_decay": 0.0, "warmup": 0.03, "schedule": "cosine",
        "betas": [0.9, 0.999], "batch_size": 8, "clip_grad": 1.0, "log_every": 10, "seed": args.seed,
    }
    cfg.update(train)
    cfg["out_dir"] = str(args.out)
    if args.no_progress:
        cfg["progress"] = False
    bs = int(cfg["batch_size"])
    if "max_steps" not in train:
        per_epoch = epoch_updates(n_train, bs, int(cfg.get("grad_accum", 1)))
        epochs = float(shared(args, "epochs", 1.0))
        cfg["max_steps"] = epochs_to_steps(epochs, per_epoch)
        if cfg["max_steps"] < FEW_STEPS:
            warnings.warn(_few_steps(epochs, n_train, bs, cfg["max_steps"], per_epoch, lora), stacklevel=2)
    if n_dev and "max_eval_batches" not in train:
        cfg["max_eval_batches"] = -(-n_dev // bs)
    return from_dict(TrainConfig, cfg, "train")


def _few_steps(epochs: float, n_train: int, batch: int, steps: int, per_epoch: int, lora: bool) -> str:
    """The warning for a run too short to learn: on a small set the default single epoch is a handful of
    updates, which at fine-tuning learning rates barely moves the loss (50 conversations at batch 8: 7 steps)."""
    more = math.ceil(FEW_STEPS / per_epoch)
    hint = "; LoRA learns faster with --lora-targets all-linear and a higher train.lr" if lora else ""
    return (f"{epochs:g} epoch(s) of {n_train} conversation(s) at batch {batch} is {steps} optimizer step(s), too few "
            f"to learn much: pass --epochs {more} (~{more * per_epoch} steps) or train.max_steps=N{hint}")


def _lora_config(args: argparse.Namespace) -> Any:
    from qkv.finetune.lora import LoRAConfig

    cfg = LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                     targets=[t.strip() for t in args.lora_targets.split(",") if t.strip()])
    cfg.validate()
    return cfg


def _lora_settings(lora: Any) -> dict[str, Any] | None:
    """What finetune.json records of the LoRA settings (None: full fine-tuning)."""
    return None if lora is None else {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
                                      "targets": lora.targets}


def _check_same_lora(out: Path, lora: Any) -> None:
    """--resume continues the run OUT recorded: refuse other LoRA settings. A different rank would not fit the
    checkpoint, but a different alpha (the update's scale), dropout or target list would load and silently
    train another function than the one the checkpoint's adapters were trained for."""
    try:
        saved = json.loads((out / FINETUNE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if not isinstance(saved, dict) or "lora" not in saved:
        return
    before, now = saved["lora"], _lora_settings(lora)
    if before == now:
        return
    if before is None or now is None:
        raise ConfigError(f"--resume: {out} is a {'full fine-tuning' if before is None else 'LoRA'} run; pass "
                          f"{'no --lora flags' if before is None else '--lora and its settings'} as it was started")
    key = next((k for k in now if now[k] != before.get(k)), None)
    if key is None:
        raise ConfigError(f"--resume: {out} was trained with other LoRA settings ({before}); pass the same ones")
    raise ConfigError(f"--resume: {out} was trained with --lora-{key} {_show(before.get(key))}, not "
                      f"{_show(now[key])}; pass the same LoRA settings to continue it")


def _show(value: Any) -> str:
    return ",".join(value) if isinstance(value, list) else f"{value:g}" if isinstance(value, float) else str(value)


@torch.no_grad()
def assistant_loss(model: torch.nn.Module, examples: list[Example], pad_id: int, batch_size: int = 8) -> float:
    """Mean cross-entropy per assistant token over `examples` (eval mode)."""
    was = model.training
    model.eval()
    total = n = 0.0
    device = next(model.parameters()).device
    for s in range(0, len(examples), batch_size):
        out = model(**{k: v.to(device) for k, v in collate(examples[s:s + batch_size], pad_id).items()})
        total += float(out.loss) * float(out.n_targets)
        n += float(out.n_targets)
    model.train(was)
    return total / max(n, 1.0)


def _max_length(args: argparse.Namespace, model: torch.nn.Module) -> int:
    """--max-length, checked against the model's context (its default)."""
    # the longest sequence the model accepts: its context_limit where it has one (an absolute position table,
    # or a sliding window it refuses to exceed: Mistral), else the context length it declares (RoPE)
    context = getattr(model, "context_limit", None) or getattr(model.config, "context_length", None)
    if args.max_length is not None and args.max_length < 1:
        raise ConfigError(f"--max-length must be a positive number of tokens, got {args.max_length}")
    max_length = args.max_length or context
    if max_length is None:
        raise ConfigError("the model declares no context length: pass --max-length")
    if context is not None and max_length > context:
        raise ConfigError(f"--max-length {max_length} is over the model's context of {context}")
    return max_length


def _report(args: argparse.Namespace, settings: dict[str, Any], summary: dict[str, Any], lora: Any,
            notes: list[str], exported_best: bool) -> list[str]:
    """The lines `qkv finetune` prints at the end: what was trained, what was skipped, the losses, and which
    step's weights the model folder holds."""
    trainable, total = settings["trainable_parameters"], settings["parameters"]
    what = (f"LoRA r={lora.rank} alpha={lora.alpha:g} on {','.join(lora.targets)}: " if lora else "full fine-tuning: ")
    lines = [f"fine-tuned {settings['source']} on {settings['examples']} conversations ({args.data}), "
             f"{summary['steps']} steps; {what}{trainable:,} of {total:,} parameters trained "
             f"({100 * trainable / total:.2f}%)"]

    def listed(lines_: list[int]) -> str:
        return ", ".join(map(str, lines_[:20])) + (" ..." if len(lines_) > 20 else "")

    skipped, dev_skipped, max_length = settings["skipped_lines"], settings["dev_skipped_lines"], settings["max_length"]
    if skipped:
        lines.append(f"skipped {len(skipped)} training record(s) over {max_length} tokens ({args.data} lines "
                     f"{listed(skipped)})")
    if dev_skipped:
        lines.append(f"skipped {len(dev_skipped)} dev record(s) over {max_length} tokens ({args.dev} lines "
                     f"{listed(dev_skipped)})" + ("; no dev record is left: no dev loss" if not settings["dev_examples"]
                                                 else ""))
    lines += notes
    lines.append(f"train loss (assistant tokens), last step: {summary['final_loss']:.4f}")
    if settings["dev_examples"]:
        lines.append(f"dev loss (assistant tokens): {settings['dev_loss_before']:.4f} before -> "
                     f"{settings['dev_loss_after']:.4f} after")
    return lines + weights_lines(Path(args.out), settings["format"], lora, summary, exported_best)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from qkv import from_pretrained
    from qkv.run import model_folder
    from qkv.train import Trainer
    from qkv.train.rng import seed_everything

    stray = sorted(d for d in getattr(args, "given_flags", ()) if d.startswith("lora_"))
    if stray and not args.lora:  # LoRA settings without LoRA: the user meant LoRA, full fine-tuning would run
        raise ConfigError(f"--{stray[0].replace('_', '-')} needs --lora (without it every weight is trained)")
    source = model_folder(args.model)
    out = Path(args.out)  # checked by qkv.finetune.check_out before this recipe runs
    check_exportable(source)
    lora = _lora_config(args) if args.lora else None
    if args.resume:
        _check_same_lora(out, lora)
    records = read_chats(args.data)
    dev_records = read_chats(args.dev) if args.dev else []

    tok = _tokenizer(source)
    notes = []
    if not tok.has_chat_template:
        notes.append(f"note: {source} has no chat template: conversations are rendered as qkv chat's plain "
                     "'User: ... / Assistant: ...' transcript, each answer followed by the eos token")
        print(f"qkv: {notes[-1]}", file=sys.stderr)

    def build() -> torch.nn.Module:
        seed_everything(args.seed)  # LoRA's A matrices are random: one seed, one run
        m = from_pretrained(source)
        if lora is not None:
            from qkv.finetune.lora import apply_lora

            apply_lora(m, lora)
        return m

    model = build()
    dtype = next(model.parameters()).dtype
    if lora is None and dtype != torch.float32:
        model.float()  # full fine-tuning updates the weights themselves: in fp32 (saved back in the source dtype)
    max_length = _max_length(args, model)
    too_long = shared(args, "too_long", "error", ("error", "skip"), "chat")
    train, skipped = build_examples(tok, records, max_length, args.data, too_long)
    dev, dev_skipped = build_examples(tok, dev_records, max_length, args.dev, too_long) if args.dev else ([], [])
    if not train:
        raise ConfigError(f"{args.data}: every record was skipped (over --max-length {max_length})")
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    data = ChatData(train, dev, pad, seed=args.seed)
    cfg = _train_config(args, len(train), len(dev), lora is not None)

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    settings = {"recipe": "chat", "source": str(source), "data": str(args.data), "dev": args.dev,
                "examples": len(train), "dev_examples": len(dev), "skipped_lines": skipped,
                "dev_skipped_lines": dev_skipped, "max_length": max_length, "seed": args.seed,
                "chat_template": tok.has_chat_template,
                "lora": _lora_settings(lora),
                "trainable_parameters": trainable, "parameters": total}
    before = assistant_loss(model, dev, pad, cfg.batch_size) if dev else None
    trainer = Trainer(model, cfg, data, resume=args.resume)
    if trainer.dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        from qkv.checkpoint import atomic_write_json

        atomic_write_json(settings, out / FINETUNE_FILE)
    summary = trainer.fit()
    if not trainer.dist.is_main:
        trainer.close()
        return {"report": "", "train": summary}
    best_path = best_checkpoint(args, summary)
    final = final_model(trainer, build, best_path)
    trainer.close()
    final.eval()
    after = assistant_loss(final, dev, pad, cfg.batch_size) if dev else None
    if lora is not None:
        from qkv.finetune.lora import merge_lora

        merge_lora(final)
    final.to(device="cpu", dtype=dtype)
    fmt = save_model_folder(final, source, out)
    exported = summary["best_eval"]["step"] if best_path else summary["steps"]
    settings.update({"format": fmt, "steps": summary["steps"], "exported_step": exported,
                     "final_train_loss": summary["final_loss"],
                     "dev_loss_before": before, "dev_loss_after": after})
    from qkv.checkpoint import atomic_write_json

    atomic_write_json(settings, out / FINETUNE_FILE)
    lines = _report(args, settings, summary, lora, notes, best_path is not None)
    return {"report": "\n".join(lines), "train": summary, "settings": settings, "out": out}


register_recipe(Recipe("chat", ("decoder",), "decoder models: chat / instruction data, loss on the assistant's "
                       "tokens only; full fine-tuning or LoRA", run, add_arguments, distributed=True))
