"""The speedrun's data, from what every machine with Python has: the standard library's own sources.

Modules are split into train / held-out by qkv.tasks.corpora's stable hash of their path, before anything is
trained: the tokenizer, the pretraining text, the SFT conversations and the synthetic tasks' word list come
from train modules only; every evaluation reads held-out modules only.

Conversations (deterministic given the modules and the seed):
  doc QA      "What does `textwrap.dedent` do?" -> the first sentence of its docstring
  signature   "Which function of `textwrap` does this? <first sentence>" -> "`dedent(text)`"
  identity    "Who are you?" and a few rephrasings -> one fixed self-description
  arithmetic  "What is 37 + 48?" -> "85" (sums of two numbers below 100)
  spelling    "Spell `parser` letter by letter." -> "p a r s e r"
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass
from pathlib import Path

from qkv.tasks.corpora import is_val_file, stdlib_files, stdlib_root

IDENTITY = ("I am a small language model that qkv trained from scratch on the Python standard library, "
            "then taught to chat. I can say what stdlib functions do, add small numbers and spell words.")
IDENTITY_QUESTIONS = ("Who are you?", "What are you?", "Introduce yourself.", "Who made you?",
                      "What can you do?", "Tell me about yourself.")
SYSTEM_PROMPT = "You are a helpful assistant that knows the Python standard library."
WORD = re.compile(r"[a-z]{4,10}")


@dataclass(frozen=True)
class Documented:
    """A public function or class of a module with a docstring."""

    module: str  # dotted module name: json.decoder
    name: str  # qualified inside the module: JSONDecoder.decode
    signature: str  # dedent(text)
    sentence: str  # the docstring's first sentence

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.name}"


def module_name(path: str) -> str:
    """json/decoder.py -> json.decoder; email/__init__.py -> email."""
    name = path[:-3].replace("/", ".")
    return name.removesuffix(".__init__")


def split_modules(val_fraction: float, max_modules: int = 0,
                  root: Path | None = None) -> dict[str, list[str]]:
    """{"train": paths, "val": paths}: the stdlib's files split by module (corpora.is_val_file).
    max_modules > 0 keeps that many of the smallest train modules and a quarter as many held-out ones (a
    test's or a quick profile's scale); which side a module is on does not change."""
    files = stdlib_files(root)
    split = {"train": [p for p in files if not is_val_file(p, val_fraction)],
             "val": [p for p in files if is_val_file(p, val_fraction)]}
    if max_modules:
        root = root or stdlib_root()
        for side, paths in split.items():
            keep = sorted(paths, key=lambda p: ((root / p).stat().st_size, p))
            # small modules first, but not the near-empty __init__ files
            n = max_modules if side == "train" else max(2, max_modules // 4)
            split[side] = sorted([p for p in keep if (root / p).stat().st_size > 2000][:n])
    return split


def read_modules(paths: list[str], root: Path | None = None) -> dict[str, str]:
    """{path: source} of the files that are UTF-8 text."""
    root = root or stdlib_root()
    out = {}
    for p in paths:
        try:
            out[p] = (root / p).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
    return out


def corpus_text(sources: dict[str, str]) -> str:
    """The modules joined as qkv.tasks.corpora joins them: a `# file: PATH` line before each."""
    return "\n".join(f"# file: {p}\n{text}" for p, text in sorted(sources.items()))


def first_sentence(doc: str, limit: int = 160) -> str | None:
    """The docstring's first sentence (its first paragraph up to '. '), one line; None when it is empty or
    longer than `limit` characters."""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    if not para:
        return None
    m = re.search(r"(?<=[.!?])\s", para)
    sentence = para[:m.start()] if m else para
    return sentence if 10 <= len(sentence) <= limit else None


def documented(path: str, source: str) -> list[Documented]:
    """The module's public functions, classes and methods of public classes that have a docstring."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    mod = module_name(path)
    out: list[Documented] = []

    def visit(nodes: list[ast.stmt], prefix: str) -> None:
        for node in nodes:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            if node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            sentence = first_sentence(doc) if doc else None
            name = prefix + node.name
            if sentence:
                if isinstance(node, ast.ClassDef):
                    sig = node.name
                else:
                    args = ast.unparse(node.args)
                    if prefix and args.startswith("self"):
                        args = args[4:].lstrip(", ")
                    sig = f"{node.name}({args})"
                if len(sig) <= 80:
                    out.append(Documented(mod, name, sig, sentence))
            if isinstance(node, ast.ClassDef) and not prefix:
                visit(node.body, f"{node.name}.")

    visit(tree.body, "")
    return out


def doc_qa(items: list[Documented]) -> list[dict]:
    """One "what does X do" conversation per documented name, and one "which function does this" for each
    function (the answer names the signature)."""
    rows = []
    for d in items:
        rows.append(chat(f"What does `{d.dotted}` do?", d.sentence))
        if "(" in d.signature:
            rows.append(chat(f"Which function of `{d.module}` does this? {d.sentence}", f"`{d.signature}`"))
    return rows


def identity_chats(copies: int) -> list[dict]:
    """The identity set: each question `copies` times, with and without the system prompt."""
    rows = []
    for i in range(copies):
        for q in IDENTITY_QUESTIONS:
            rows.append(chat(q, IDENTITY, SYSTEM_PROMPT if i % 2 else None))
    return rows


def addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(100), rng.randrange(100)
    return f"What is {a} + {b}?", str(a + b)


def spelling(word: str) -> tuple[str, str]:
    return f"Spell `{word}` letter by letter.", " ".join(word)


def words_of(sources: dict[str, str]) -> list[str]:
    """The distinct lower-case words (4-10 letters) of the modules' identifiers and text, sorted."""
    return sorted({w for text in sources.values() for w in WORD.findall(text)})


def synthetic(n: int, words: list[str], seed: int, exclude: set[str] = frozenset()) -> list[tuple[str, str]]:
    """n (question, answer) pairs, half sums, half spellings, none of whose question is in `exclude`."""
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    tries = 0
    while len(out) < n and tries < 100 * n:
        tries += 1
        qa = addition(rng) if len(out) % 2 == 0 or not words else spelling(rng.choice(words))
        if qa[0] not in exclude:
            out.append(qa)
            exclude = exclude | {qa[0]}
    return out


def chat(question: str, answer: str, system: str | None = None) -> dict:
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return {"messages": messages}


__all__ = ["IDENTITY", "SYSTEM_PROMPT", "Documented", "chat", "corpus_text", "doc_qa", "documented",
           "first_sentence", "identity_chats", "module_name", "read_modules", "split_modules", "synthetic",
           "words_of"]
