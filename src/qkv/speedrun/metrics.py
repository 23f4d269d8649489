"""The speedrun's answer scores: ROUGE-L F1 and token F1 (SQuAD's) over lower-case alphanumeric words, exact
match, and whether a generated function parses.

ROUGE-L is Google's `rouge_score` without stemming (the docstrings' words as written); token F1 splits
words as that package does (lower case, runs of [a-z0-9]).
"""

from __future__ import annotations

import ast
import re
from collections import Counter

from rouge_score import rouge_scorer

WORDS = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    return WORDS.findall(text.lower())


# one scorer for every answer: it holds no state between pairs
ROUGE_L = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 (Lin 2004): the longest common subsequence of words, F1 of its precision and recall."""
    return ROUGE_L.score(reference, prediction)["rougeL"].fmeasure


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD's token F1: the overlap of the two bags of words."""
    p, r = words(prediction), words(reference)
    common = sum((Counter(p) & Counter(r)).values())
    if not common:
        return 0.0
    precision, recall = common / len(p), common / len(r)
    return 2 * precision * recall / (precision + recall)


def exact(prediction: str, reference: str) -> bool:
    """Equal after trimming spaces and a final period."""
    return prediction.strip().rstrip(".").strip() == reference.strip()


def function_source(header: str, continuation: str) -> str:
    """The function a model wrote after `header` (a `def ...:` line): its lines up to the first one that is
    back at the header's indentation, cut to whole lines."""
    lines = continuation.split("\n")
    if len(lines) > 1:
        lines = lines[:-1]  # the last line may be cut mid-way by the token limit
    body = []
    for line in lines:
        if line.strip() and not line[:1].isspace():
            break
        body.append(line)
    return header + "\n".join(body)


def parses(source: str) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):  # ValueError: a null byte
        return False
    return True


__all__ = ["exact", "function_source", "parses", "rouge_l", "token_f1", "words"]
