"""The `chat` recipe: instruction fine-tuning of a decoder model on conversations, the loss on what the
assistant says and nothing else.

    qkv finetune DIR --data chats.jsonl --out OUT [--dev dev.jsonl] [--lora [--lora-rank 8 ...]]
                 [--max-length N] [--too-long error|skip] [--epochs E] [train.key=value ...]

Data: one JSON object per line, either
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
    {"prompt": "...", "completion": "..."}          (optionally "system": "...")
    {"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}, ...]}  (ShareGPT; "system" too)
Each conversation is rendered with the model folder's own chat template (so the fine-tuned model is prompted
exactly as `qkv chat` will prompt it) and tokenized; labels are the token ids on the assistant's tokens (its
content and the end-of-turn token after it, so the model learns to stop) and -100 everywhere else: the system
prompt, the user's turns and the template's role markers add nothing to the loss. A folder without a chat
template gets `qkv chat`'s plain transcript ("User: ...\nAssistant: ..."), each answer followed by eos, with a
note.

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

import json
import math
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qkv import from_pretrained
from qkv.config import ConfigError, from_dict, setting
from qkv.finetune.chat_data import (  # noqa: F401  (the data half of this recipe, imported from here too)
    IGNORE,
    ChatData,
    assistant_loss,
    build_examples,
    encode_chat,
    read_chats,
)
from qkv.finetune.chat_images import prepare_vlm, vision_data
from qkv.finetune.chat_output import (
    best_checkpoint,
    check_exportable,
    final_model,
    save_model_folder,
    weights_lines,
)
from qkv.finetune.chat_template import (
    CHAT_TEMPLATE_FILE,
    QKV_CHAT_TEMPLATE,
    run_tokenizer,
    write_chat_tokenizer,
)
from qkv.finetune.lora import LoRAConfig, apply_lora, merge_lora
from qkv.finetune.out import FINETUNE_FILE, mark_out
from qkv.finetune.recipe import FinetuneRecipe, epoch_updates, epochs_to_steps
from qkv.finetune.registry import Recipe, register_recipe
from qkv.finetune.settings import FinetuneSettings
from qkv.interop.export_tokenizer import copy_tokenizer_files
from qkv.interop.tokenizer import load_hf_tokenizer
from qkv.models.vlm import LLaVA
from qkv.run import model_folder
from qkv.storage import atomic_write_json, atomic_write_text, read_config
from qkv.train import TrainConfig, Trainer
from qkv.train.distributed import launched_by_torchrun
from qkv.train.rng import seed_everything

FEW_STEPS = 50  # fewer optimizer steps than this, set by --epochs rather than train.max_steps: a warning


# -- the settings ---------------------------------------------------------------------------------------
LORA_DEFAULTS = {"lora_rank": 8, "lora_alpha": 16.0, "lora_dropout": 0.05, "lora_targets": "q,v"}


@dataclass(kw_only=True)
class ChatSettings(FinetuneSettings):
    """The chat recipe's settings. The LoRA settings are None unless given (LORA_DEFAULTS then stand): given
    without --lora, the user meant LoRA and full fine-tuning would run, so that is an error."""

    RECIPE = "chat"
    TOO_LONG = ("error", "skip")

    epochs: float = 1.0
    lora: bool = setting(False, "train LoRA adapters instead of every weight (merged on save)")
    lora_rank: int | None = setting(None, "LoRA rank r", none="8")
    lora_alpha: float | None = setting(None, "LoRA alpha; the update is scaled by alpha/r", none="16")
    lora_dropout: float | None = setting(None, "dropout on the adapters' input", none="0.05")
    lora_targets: str | None = setting(None, "layers to adapt, comma separated: q,k,v (slices of the "
                                             "fused attention projection), out_proj, up, gate, down, Hugging "
                                             "Face names (q_proj, o_proj, ...), globs, or all-linear",
                                       none="q,v")
    export: str = setting("best", "the weights OUT holds: the best dev loss's checkpoint when --dev was "
                                  "evaluated more than once (best), or the last step's (last)",
                          choices=("best", "last"))
    chat_template: str | None = setting(None, "for a folder without a chat template: write qkv's (role "
                                              "lines, each turn ended by eos) into OUT and fine-tune with "
                                              "it, instead of the plain 'User:/Assistant:' transcript",
                                        choices=("qkv",))
    max_length: int | None = setting(None, "longest conversation in tokens (default and upper bound: the "
                                           "longest sequence the model accepts, its context length or a "
                                           "shorter sliding window)")

    def __post_init__(self) -> None:
        super().__post_init__()
        stray = sorted(name for name in LORA_DEFAULTS if getattr(self, name) is not None)
        if stray and not self.lora:
            raise ConfigError(f"--{stray[0].replace('_', '-')} needs --lora (without it every weight is "
                              "trained)")
        if self.lora:
            self.lora_config().validate()

    def lora_config(self) -> LoRAConfig | None:
        """The LoRA settings (None: full fine-tuning)."""
        if not self.lora:
            return None
        given = {name: getattr(self, name) for name in LORA_DEFAULTS}
        v = {name: LORA_DEFAULTS[name] if value is None else value for name, value in given.items()}
        return LoRAConfig(rank=v["lora_rank"], alpha=v["lora_alpha"], dropout=v["lora_dropout"],
                          targets=[t.strip() for t in str(v["lora_targets"]).split(",") if t.strip()])


# -- the recipe ---------------------------------------------------------------------------------------------
def _train_config(s: ChatSettings, n_train: int, n_dev: int, lora: bool) -> Any:
    """TrainConfig: fine-tuning defaults, then the command line's train.key=value."""
    train = s.train
    cfg: dict[str, Any] = {
        # the usual instruction-tuning settings: a small LR for full fine-tuning, ten times that for LoRA
        # (its update starts at zero and is scaled by alpha/r), no weight decay, short warmup, cosine decay
        "lr": 2e-4 if lora else 2e-5, "weight_decay": 0.0, "warmup": 0.03, "schedule": "cosine",
        "betas": [0.9, 0.999], "batch_size": 8, "clip_grad": 1.0, "log_every": 10, "seed": s.seed,
    }
    cfg.update(train)
    cfg["out_dir"] = str(s.out)
    if not s.progress:
        cfg["progress"] = False
    bs = int(cfg["batch_size"])
    if "max_steps" not in train:
        per_epoch = epoch_updates(n_train, bs, int(cfg.get("grad_accum", 1)))
        epochs = float(s.epochs)
        cfg["max_steps"] = epochs_to_steps(epochs, per_epoch)
        if cfg["max_steps"] < FEW_STEPS:
            warnings.warn(_few_steps(epochs, n_train, bs, cfg["max_steps"], per_epoch, lora), stacklevel=2)
    if n_dev and "max_eval_batches" not in train:
        cfg["max_eval_batches"] = -(-n_dev // bs)
    return from_dict(TrainConfig, cfg, "train")


def _few_steps(epochs: float, n_train: int, batch: int, steps: int, per_epoch: int, lora: bool) -> str:
    """The warning for a run too short to learn: on a small set the default single epoch is a handful of
    updates, which at fine-tuning learning rates barely moves the loss (50 conversations at batch 8: 7
    steps)."""
    more = math.ceil(FEW_STEPS / per_epoch)
    hint = "; LoRA learns faster with --lora-targets all-linear and a higher train.lr" if lora else ""
    return (f"{epochs:g} epoch(s) of {n_train} conversation(s) at batch {batch} is {steps} optimizer "
            f"step(s), too few to learn much: pass --epochs {more} (~{more * per_epoch} steps) or "
            f"train.max_steps=N{hint}")


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
        raise ConfigError(f"--resume: {out} is a {'full fine-tuning' if before is None else 'LoRA'} run; "
                          f"pass {'no --lora flags' if before is None else '--lora and its settings'} as it "
                          "was started")
    key = next((k for k in now if now[k] != before.get(k)), None)
    if key is None:
        raise ConfigError(f"--resume: {out} was trained with other LoRA settings ({before}); pass the same "
                          "ones")
    raise ConfigError(f"--resume: {out} was trained with --lora-{key} {_show(before.get(key))}, not "
                      f"{_show(now[key])}; pass the same LoRA settings to continue it")


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _max_length(requested: int | None, model: torch.nn.Module) -> int:
    """--max-length, checked against the model's context (its default)."""
    # the longest sequence the model accepts: its context_limit where it has one (an absolute position table,
    # or a sliding window it refuses to exceed: Mistral), else the context length it declares (RoPE)
    context = getattr(model, "context_limit", None) or getattr(model.config, "context_length", None)
    if requested is not None and requested < 1:
        raise ConfigError(f"--max-length must be a positive number of tokens, got {requested}")
    max_length = requested or context
    if max_length is None:
        raise ConfigError("the model declares no context length: pass --max-length")
    if context is not None and max_length > context:
        raise ConfigError(f"--max-length {max_length} is over the model's context of {context}")
    return max_length


def _listed(lines: list[int]) -> str:
    return ", ".join(map(str, lines[:20])) + (" ..." if len(lines) > 20 else "")


class ChatRecipe(FinetuneRecipe):
    """The chat recipe in named phases, each returning what it made (and keeping it for the next):

        setup_model() -> model      the source folder checked, its tokenizer, the model (LoRA applied)
        setup_data()  -> ChatData   the conversations read, rendered and checked against --max-length
        train()       -> summary    the Trainer's run (OUT/finetune.json written first, for --resume)
        save()        -> settings   OUT as a model folder (best or last weights, LoRA merged), finetune.json
        report()      -> lines      what `qkv finetune` prints

    `notes` collects what the user should know before training starts (no chat template); on the ranks of a
    torchrun launch other than 0, train() is the last phase."""

    name = "chat"
    settings = ChatSettings

    def __init__(self, settings: ChatSettings) -> None:
        super().__init__(settings)
        self.lora = settings.lora_config()
        self.private: tempfile.TemporaryDirectory | None = None  # see tokenizer_folder

    def setup_model(self) -> torch.nn.Module:
        s = self.s
        self.source = model_folder(s.model)
        check_exportable(self.source)  # OUT itself was checked by qkv.finetune.check_out before this recipe
        if s.resume:
            _check_same_lora(s.out, self.lora)
        self.tok = self.setup_tokenizer()
        if not self.tok.has_chat_template:
            self.notes.append(f"note: {self.source} has no chat template: conversations are rendered as qkv "
                              "chat's plain 'User: ... / Assistant: ...' transcript, each answer followed by "
                              "the eos token (--chat-template qkv gives OUT qkv's template instead)")
        self.model = self.build()
        self.dtype = next(self.model.parameters()).dtype
        if self.lora is None and self.dtype != torch.float32:
            # full fine-tuning updates the weights themselves: in fp32 (saved in the source dtype)
            self.model.float()
        return self.model

    def setup_tokenizer(self) -> Any:
        """The tokenizer conversations are rendered with: the source folder's, or one written into OUT with
        qkv's chat template (finetune.chat_template) for a qkv run, which keeps its tokenizer in qkv's form,
        and for a folder without a template when --chat-template qkv asks for it."""
        s = self.s
        own = run_tokenizer(Path(s.model), self.source)
        if own is not None:
            mark_out(s.out, "chat")  # OUT is this recipe's before anything is written into it
            context = read_config(self.source).get("config", {}).get("context_length")
            where = self.tokenizer_folder()
            write_chat_tokenizer(own, where, context)
            return load_hf_tokenizer(where)
        tok = load_hf_tokenizer(self.source)
        if s.chat_template is None:
            return tok
        if tok.has_chat_template:
            raise ConfigError(f"--chat-template {s.chat_template}: {self.source} has a chat template of its "
                              "own; drop the flag to fine-tune with it")
        if tok.eos_token is None:
            raise ConfigError(f"--chat-template qkv ends each turn with the eos token; {self.source} has "
                              "none")
        mark_out(s.out, "chat")
        where = self.tokenizer_folder()
        copy_tokenizer_files(self.source, where, generation=False)
        atomic_write_text(QKV_CHAT_TEMPLATE, where / CHAT_TEMPLATE_FILE)
        return load_hf_tokenizer(where)

    def tokenizer_folder(self) -> Path:
        """Where the tokenizer with its template is written: OUT, which only rank 0 writes; under torchrun the
        other ranks write the same files into a folder of their own (kept as long as the recipe)."""
        if not launched_by_torchrun() or os.environ["RANK"] == "0":
            return Path(self.s.out)
        self.private = tempfile.TemporaryDirectory(prefix="qkv-chat-tokenizer-")
        return Path(self.private.name)

    def build(self) -> torch.nn.Module:
        """A fresh copy of the source model, seeded (LoRA's A matrices are random: one seed, one run)."""
        seed_everything(self.s.seed)
        m = from_pretrained(self.source)
        if isinstance(m, LLaVA):  # LoRA on its language model, the projector trained, the tower frozen
            prepare_vlm(m, self.lora)
        elif self.lora is not None:
            apply_lora(m, self.lora)
        return m

    def setup_data(self) -> ChatData:
        s, tok = self.s, self.tok
        records = read_chats(s.data)
        dev_records = read_chats(s.dev) if s.dev else []
        self.max_length = _max_length(s.max_length, self.model)
        vision = vision_data(self.model, self.source)
        self.train_examples, self.skipped = build_examples(tok, records, self.max_length, s.data, s.too_long,
                                                           vision)
        self.dev_examples, self.dev_skipped = (
            build_examples(tok, dev_records, self.max_length, s.dev, s.too_long, vision) if s.dev
            else ([], []))
        if not self.train_examples:
            raise ConfigError(f"{s.data}: every record was skipped (over --max-length {self.max_length})")
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        self.data = ChatData(self.train_examples, self.dev_examples, self.pad, seed=s.seed)
        self.cfg = _train_config(s, len(self.train_examples), len(self.dev_examples), self.lora is not None)
        return self.data

    def train(self) -> dict[str, Any]:
        s, model, dev = self.s, self.model, self.dev_examples
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        self.settings = {"recipe": "chat", "source": str(self.source), "data": str(s.data), "dev": s.dev,
                         "examples": len(self.train_examples), "dev_examples": len(dev),
                         "skipped_lines": self.skipped, "dev_skipped_lines": self.dev_skipped,
                         "max_length": self.max_length, "seed": s.seed,
                         "chat_template": self.tok.has_chat_template, "lora": _lora_settings(self.lora),
                         "trainable_parameters": trainable, "parameters": total}
        self.dev_loss_before = assistant_loss(model, dev, self.pad, self.cfg.batch_size) if dev else None
        self.trainer = Trainer(model, self.cfg, self.data, resume=s.resume)
        if self.trainer.dist.is_main:
            s.out.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.settings, s.out / FINETUNE_FILE)
        self.summary = self.trainer.fit()
        self.is_main = self.trainer.dist.is_main
        if not self.is_main:  # rank 0 alone exports and reports
            self.trainer.close()
        return self.summary

    def save(self) -> dict[str, Any]:
        """Rank 0's export: the chosen weights evaluated on --dev, LoRA merged, OUT written."""
        s, summary, dev = self.s, self.summary, self.dev_examples
        self.best_path = best_checkpoint(s.export, summary)
        final = final_model(self.trainer, self.build, self.best_path)
        self.trainer.close()
        final.eval()
        after = assistant_loss(final, dev, self.pad, self.cfg.batch_size) if dev else None
        if self.lora is not None:
            merge_lora(final)
        final.to(device="cpu", dtype=self.dtype)
        fmt = save_model_folder(final, self.source, s.out)
        exported = summary["best_eval"]["step"] if self.best_path else summary["steps"]
        self.settings.update({"format": fmt, "steps": summary["steps"], "exported_step": exported,
                              "final_train_loss": summary["final_loss"],
                              "dev_loss_before": self.dev_loss_before, "dev_loss_after": after})
        atomic_write_json(self.settings, s.out / FINETUNE_FILE)
        return self.settings

    def report(self) -> list[str]:
        """The lines `qkv finetune` prints at the end: what was trained, what was skipped, the losses, and
        which step's weights the model folder holds."""
        s, st, summary, lora = self.s, self.settings, self.summary, self.lora
        trainable, total = st["trainable_parameters"], st["parameters"]
        what = (f"LoRA r={lora.rank} alpha={lora.alpha:g} on {','.join(lora.targets)}: " if lora
                else "full fine-tuning: ")
        lines = [f"fine-tuned {st['source']} on {st['examples']} conversations ({s.data}), "
                 f"{summary['steps']} steps; {what}{trainable:,} of {total:,} parameters trained "
                 f"({100 * trainable / total:.2f}%)"]
        skipped, dev_skipped, max_length = st["skipped_lines"], st["dev_skipped_lines"], st["max_length"]
        if skipped:
            lines.append(f"skipped {len(skipped)} training record(s) over {max_length} tokens ({s.data} "
                         f"lines {_listed(skipped)})")
        if dev_skipped:
            none_left = "; no dev record is left: no dev loss" if not st["dev_examples"] else ""
            lines.append(f"skipped {len(dev_skipped)} dev record(s) over {max_length} tokens ({s.dev} lines "
                         f"{_listed(dev_skipped)})" + none_left)
        lines += self.notes
        lines.append(f"train loss (assistant tokens), last step: {summary['final_loss']:.4f}")
        if st["dev_examples"]:
            lines.append(f"dev loss (assistant tokens): {st['dev_loss_before']:.4f} before -> "
                         f"{st['dev_loss_after']:.4f} after")
        return lines + weights_lines(s.out, st["format"], lora, summary, self.best_path is not None)


register_recipe(Recipe("chat", ("decoder",), "decoder models: chat / instruction data, loss on the "
                       "assistant's tokens only; full fine-tuning or LoRA", ChatRecipe,
                       distributed=True))
