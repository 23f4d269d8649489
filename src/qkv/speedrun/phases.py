"""The speedrun's training phases, each writing its own part of DIR and returning its figures:

    data       DIR/data: train.txt / val.txt (modules split before anything is trained), sft.jsonl, eval.json
    tokenizer  DIR/tokenizer: a byte-level BPE on train.txt with the chat role markers reserved
    pretrain   DIR/base: a `qkv train` run folder (task lm on train.txt, held out on val.txt)
    sft        DIR/chat: `qkv finetune --task chat` of DIR/base on sft.jsonl: a model folder with a template
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from qkv.config import ConfigError
from qkv.finetune import finetune
from qkv.finetune.chat import ChatSettings
from qkv.finetune.chat_template import CHAT_ROLE_TOKENS
from qkv.nn.params import count_parameters
from qkv.run import train_run
from qkv.speedrun.data import (
    SYSTEM_PROMPT,
    chat,
    corpus_text,
    doc_qa,
    documented,
    identity_chats,
    read_modules,
    split_modules,
    synthetic,
    words_of,
)
from qkv.speedrun.profile import Profile
from qkv.storage import atomic_write_json, atomic_write_text
from qkv.tasks.lm import text_chunks
from qkv.tasks.tokenizers import BPETokenizer
from qkv.train import latest_checkpoint
from qkv.train.distributed import world_size


def data_phase(out: Path, p: Profile) -> dict[str, Any]:
    folder = out / "data"
    folder.mkdir(parents=True, exist_ok=True)
    split = split_modules(p.data.val_fraction, p.data.max_modules)
    sources = {side: read_modules(paths) for side, paths in split.items()}
    for side in ("train", "val"):
        atomic_write_text(corpus_text(sources[side]), folder / f"{side}.txt")
    train_docs = [d for path, text in sources["train"].items() for d in documented(path, text)]
    val_docs = [d for path, text in sources["val"].items() for d in documented(path, text)]
    rng = random.Random(p.seed)
    qa = doc_qa(train_docs)
    rng.shuffle(qa)
    if p.sft.max_doc_qa:
        qa = qa[:p.sft.max_doc_qa]
    words = words_of(sources["train"])
    train_synthetic = synthetic(p.sft.synthetic, words, p.seed)
    rows = qa + identity_chats(p.sft.identity_copies) + [chat(q, a) for q, a in train_synthetic]
    rng.shuffle(rows)
    atomic_write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), folder / "sft.jsonl")
    seen = {q for q, _ in train_synthetic}
    atomic_write_json(_eval_set(p, train_docs, val_docs, sources["val"], seen, rng), folder / "eval.json")
    atomic_write_json(split, folder / "split.json")
    return {"train_modules": len(sources["train"]), "val_modules": len(sources["val"]),
            "train_chars": sum(map(len, sources["train"].values())),
            "val_chars": sum(map(len, sources["val"].values())),
            "sft_conversations": len(rows), "doc_qa_conversations": len(qa),
            "held_out_documented": len(val_docs)}


def _eval_set(p: Profile, train_docs: list, val_docs: list, val_sources: dict[str, str], seen: set[str],
              rng: random.Random) -> dict[str, Any]:
    """What the evaluate phase asks: held-out modules' doc questions, function headers and synthetic tasks
    (words of held-out modules, sums not in the SFT data); the base model's few-shot examples from train."""
    docs = list(val_docs)
    rng.shuffle(docs)
    functions = [d for d in docs if "(" in d.signature and "." not in d.name]
    shots = rng.sample(train_docs, min(p.eval.few_shot, len(train_docs)))
    return {
        "doc_qa": [{"q": f"What does `{d.dotted}` do?", "a": d.sentence} for d in docs[:p.eval.doc_qa]],
        "few_shot": [{"q": f"What does `{d.dotted}` do?", "a": d.sentence} for d in shots],
        "code": [f"def {d.signature}:\n" for d in functions[:p.eval.code]],
        "synthetic": [{"q": q, "a": a} for q, a in synthetic(p.eval.synthetic, words_of(val_sources),
                                                              p.seed + 1, seen)],
        "system": SYSTEM_PROMPT,
    }


def tokenizer_phase(out: Path, p: Profile) -> dict[str, Any]:
    text = (out / "data" / "train.txt").read_text(encoding="utf-8")
    tok = BPETokenizer.train(text_chunks(text), vocab_size=p.tokenizer.vocab_size,
                             extra_specials=CHAT_ROLE_TOKENS)
    tok.save(out / "tokenizer")
    val = (out / "data" / "val.txt").read_text(encoding="utf-8")
    n_tokens = sum(len(ids) for ids in tok.encode_batch(text_chunks(val)))
    return {"vocab_size": tok.vocab_size, "val_bytes_per_token": len(val.encode("utf-8")) / max(1, n_tokens)}


def pretrain_config(out: Path, p: Profile) -> dict[str, Any]:
    """The `qkv train` run config of the pretraining phase."""
    train = {"max_steps": 1000, "batch_size": 16, "lr": 3e-3, "min_lr": 3e-4, "warmup": 0.05,
             "betas": [0.9, 0.95], "weight_decay": 0.1, "log_every": 10, "save_every": 100, "keep_last": 1,
             "seed": p.seed, **p.pretrain.train}
    train["batch_size"] = per_rank(train["batch_size"], "pretrain")
    return {"model": {"family": "gpt", **p.pretrain.model},
            "task": {"name": "lm", "path": str(out / "data" / "train.txt"),
                     "val_path": str(out / "data" / "val.txt"), "tokenizer": "bpe",
                     "tokenizer_file": str(out / "tokenizer" / "tokenizer.json"),
                     "context": p.pretrain.context,
                     "sample_prompt": "def ", "sample_tokens": 64},
            "train": train, "eval": {"n": p.pretrain.eval_windows, "samples": 1}}


def pretrain_phase(out: Path, p: Profile, quiet: bool, bytes_per_token: float) -> dict[str, Any]:
    """`qkv train` into DIR/base; a partial run (checkpoints, no record) continues as `--resume` does.
    bytes_per_token: the tokenizer's on the held-out text, turning nats per token into bits per byte."""
    cfg = pretrain_config(out, p)
    result = train_run(cfg, out / "base", resume=True, quiet=quiet)  # the NaN guard raises: `qkv` exits 3
    train = cfg["train"]
    steps = int(result["train"]["steps"])
    metrics = result["metrics"]
    return {"steps": steps, "parameters": count_parameters(result["model"]),
            "tokens_seen": steps * int(train["batch_size"]) * world_size() * int(train.get("grad_accum", 1))
            * p.pretrain.context,
            "final_train_loss": result["train"].get("final_loss"), "val_loss": metrics.get("val_loss"),
            "val_bits_per_byte": metrics["val_loss"] / math.log(2) / bytes_per_token
            if "val_loss" in metrics else None,
            "sample": (result["samples"] or [""])[0]}


def sft_phase(out: Path, p: Profile, quiet: bool) -> dict[str, Any]:
    """`qkv finetune DIR/base --task chat` into DIR/chat (resumed when it has checkpoints)."""
    chat = out / "chat"
    train = {"batch_size": 16, "lr": 1e-3 if p.sft.lora else 3e-4, "log_every": 10, "save_every": 100,
             "keep_last": 1, "warmup": 0.05, **p.sft.train}
    train["batch_size"] = per_rank(train["batch_size"], "sft")
    lora = {"lora_rank": p.sft.lora_rank, "lora_alpha": 2.0 * p.sft.lora_rank, "lora_dropout": 0.0,
            "lora_targets": "all-linear"} if p.sft.lora else {}
    result = finetune(ChatSettings(
        model=str(out / "base"), data=str(out / "data" / "sft.jsonl"), out=chat, seed=p.seed,
        resume=latest_checkpoint(chat / "checkpoints") is not None, progress=not quiet, epochs=p.sft.epochs,
        too_long="skip", train=train, lora=p.sft.lora, **lora, export="last"))
    if not result.record:  # a rank other than 0 under torchrun: rank 0 reports and records the phase
        return {}
    settings = result.record
    return {"steps": settings["steps"], "conversations": settings["examples"],
            "skipped_too_long": len(settings["skipped_lines"]), "lora": p.sft.lora,
            "trainable_parameters": settings["trainable_parameters"], "parameters": settings["parameters"],
            "final_train_loss": settings["final_train_loss"]}


def per_rank(batch_size: int, phase: str) -> int:
    """Each rank's share of a phase's batch under torchrun, so that the global batch (and with it the run)
    is the profile's whatever the number of processes."""
    world = world_size()
    if batch_size % world:
        raise ConfigError(f"{phase}.train.batch_size={batch_size} does not divide among the {world} "
                          "processes of this torchrun launch; choose a multiple of it")
    return batch_size // world


__all__ = ["data_phase", "per_rank", "pretrain_config", "pretrain_phase", "sft_phase", "tokenizer_phase"]
