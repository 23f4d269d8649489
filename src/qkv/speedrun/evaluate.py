"""The speedrun's evaluation, on held-out modules only (DIR/data/eval.json, written by the data phase):

  doc QA     "What does `mod.name` do?" of held-out functions and classes: the SFT model through its chat
             template against the base model prompted few-shot (Q:/A: pairs from train modules), each scored
             by ROUGE-L F1 and token F1 against the docstring's real first sentence
  code       held-out functions' `def` lines continued by the base model: the share ast.parse accepts
  synthetic  held-out sums and spellings asked of the SFT model: exact match, beside chance
  samples    a few conversations with the SFT model

Every answer is greedy, so the evaluation is deterministic. The figures are written to DIR/eval/results.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from qkv import from_pretrained
from qkv.generate import generate
from qkv.interop.tokenizer import load_hf_tokenizer
from qkv.run import model_folder
from qkv.speedrun.data import IDENTITY_QUESTIONS
from qkv.speedrun.metrics import exact, function_source, parses, rouge_l, token_f1
from qkv.speedrun.profile import Profile
from qkv.storage import atomic_write_json
from qkv.tasks.tokenizers import load_tokenizer

BATCH = 16
INDENT = "    "  # a function body's first indentation (PEP 8)
ADDITION_CHANCE = 1 / 199  # a sum of two numbers below 100 is one of 199 values


@torch.no_grad()
def continue_batch(model: Any, prompts: list[list[int]], max_new: int, stop: set[int],
                   pad: int) -> list[list[int]]:
    """Each prompt's greedy continuation, cut before its first `stop` id; prompts left-padded into batches of
    BATCH."""
    out: list[list[int]] = []
    for s in range(0, len(prompts), BATCH):
        rows = prompts[s:s + BATCH]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        res = generate(model, ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=sorted(stop),
                       pad_token_id=pad, do_sample=False)
        for row in res[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in stop), len(row))
            out.append(row[:cut])
    return out


class ChatModel:
    """DIR/chat as `qkv chat` reads it: its weights, tokenizer and chat template."""

    def __init__(self, folder: Path) -> None:
        self.model = from_pretrained(model_folder(folder)).eval()
        self.tok = load_hf_tokenizer(folder)
        self.stop = set(self.tok.end_of_turn_ids)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0

    def answers(self, questions: list[str], max_new: int, system: str | None = None) -> list[str]:
        prompts = []
        for q in questions:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": q}]
            prompts.append(self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        return [self.tok.decode(r, skip_special_tokens=True).strip()
                for r in continue_batch(self.model, prompts, max_new, self.stop, self.pad)]


class BaseModel:
    """DIR/base: the pretrained model with the speedrun's own tokenizer, prompted as plain text."""

    def __init__(self, out: Path) -> None:
        self.model = from_pretrained(model_folder(out / "base")).eval()
        self.tok = load_tokenizer(out / "tokenizer")
        self.newline = set(self.tok.encode("\n"))

    def few_shot(self, shots: list[dict[str, str]], questions: list[str], max_new: int,
                 room: int) -> list[str]:
        head = "".join(f"Q: {s['q']}\nA: {s['a']}\n\n" for s in shots)
        prompts = [self.tok.encode(head + f"Q: {q}\nA:")[-(room - max_new):] for q in questions]
        answers = continue_batch(self.model, prompts, max_new, {self.tok.eos_id}, self.tok.pad_id)
        return [self.tok.decode(a).strip().split("\n")[0].strip() for a in answers]

    def functions(self, headers: list[str], max_new: int) -> list[str]:
        """Each `def ...:\n` header continued. The prompt ends with the body's first indent:
        a byte-level BPE reads a newline followed by spaces as one token, so a prompt ending in a bare newline
        would tell the model the next line is not indented."""
        prompts = [self.tok.encode(h + INDENT) for h in headers]
        bodies = continue_batch(self.model, prompts, max_new, {self.tok.eos_id}, self.tok.pad_id)
        return [function_source(h, INDENT + self.tok.decode(b)) for h, b in zip(headers, bodies, strict=True)]


def evaluate_phase(out: Path, p: Profile) -> dict[str, Any]:
    ev = json.loads((out / "data" / "eval.json").read_text(encoding="utf-8"))
    e = p.eval
    chat, base = ChatModel(out / "chat"), BaseModel(out)
    questions = [x["q"] for x in ev["doc_qa"]]
    refs = [x["a"] for x in ev["doc_qa"]]
    sft_answers = chat.answers(questions, e.max_new_tokens)
    base_answers = base.few_shot(ev["few_shot"], questions, e.max_new_tokens, p.pretrain.context)
    code = base.functions(ev["code"], e.code_tokens)
    syn_answers = chat.answers([x["q"] for x in ev["synthetic"]], 16)
    syn_hits = [exact(a, x["a"]) for a, x in zip(syn_answers, ev["synthetic"], strict=True)]
    sums = [h for h, x in zip(syn_hits, ev["synthetic"], strict=True) if x["q"].startswith("What is")]
    spells = [h for h, x in zip(syn_hits, ev["synthetic"], strict=True) if not x["q"].startswith("What is")]
    sample_qs = [IDENTITY_QUESTIONS[0], *questions[:1], *[x["q"] for x in ev["synthetic"][:2]]][:e.samples]
    samples = [{"user": q, "assistant": a} for q, a in zip(sample_qs, chat.answers(
        sample_qs, e.max_new_tokens, ev["system"]), strict=True)]
    results = {
        "doc_qa": {"n": len(questions), "few_shot": len(ev["few_shot"]),
                   "sft": _scores(sft_answers, refs), "base_few_shot": _scores(base_answers, refs),
                   "examples": [{"q": q, "reference": r, "sft": s, "base": b} for q, r, s, b in
                                list(zip(questions, refs, sft_answers, base_answers, strict=True))[:5]]},
        "code": {"n": len(code), "parse_rate": _mean([parses(c) for c in code]),
                 "examples": code[:2]},
        "synthetic": {"n": len(syn_hits), "exact_match": _mean(syn_hits),
                      "addition": {"n": len(sums), "exact_match": _mean(sums), "chance": ADDITION_CHANCE},
                      "spelling": {"n": len(spells), "exact_match": _mean(spells), "chance": 0.0}},
        "samples": samples,
    }
    (out / "eval").mkdir(exist_ok=True)
    atomic_write_json(results, out / "eval" / "results.json")
    return {"doc_qa_rouge_l_sft": results["doc_qa"]["sft"]["rouge_l"],
            "doc_qa_rouge_l_base": results["doc_qa"]["base_few_shot"]["rouge_l"],
            "code_parse_rate": results["code"]["parse_rate"],
            "synthetic_exact_match": results["synthetic"]["exact_match"]}


def _scores(answers: list[str], refs: list[str]) -> dict[str, float]:
    return {"rouge_l": _mean([rouge_l(a, r) for a, r in zip(answers, refs, strict=True)]),
            "token_f1": _mean([token_f1(a, r) for a, r in zip(answers, refs, strict=True)])}


def _mean(values: list[float] | list[bool]) -> float:
    return float(sum(values)) / len(values) if values else 0.0


__all__ = ["BaseModel", "ChatModel", "continue_batch", "evaluate_phase"]
