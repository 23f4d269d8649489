"""ListOps (Nangia & Bowman 2018; the Long Range Arena version, Tay et al. 2021), generated locally.

An example is a nested prefix expression over the digits 0-9 and four list operators, and the label is its
value (10-way classification):

    [MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]   ->   5

MAX, MIN; MED = median, for an even count the mean of the two middle values rounded down (LRA's
int(np.median)); SM = sum modulo 10. Tokens are whitespace-separated: '[MAX' '[MIN' '[MED' '[SM' ']' and
the digits (a WordTokenizer).

Generation (seeded by (seed, split, index)): a random tree under a token budget of max_len: a node is a
digit with probability leaf_prob (always at max_depth or when the budget is too small), otherwise an
operator with 2..max_args arguments whose children share what is left of the budget; expressions shorter
than min_len are redrawn. Split: hash of the expression string (see base.in_val_split).

Encoding (an encoder-kind model with a classification head): input_ids = [<bos> as CLS, tokens...]
right-padded, attention_mask, labels (B,) when the family's classifier pools the first token (BERT); the same
without the CLS token otherwise (a bidirectional LSTM classifier reads its final states).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qkv.config import ConfigError, setting
from qkv.models.registry import family as family_spec
from qkv.tasks.base import Task, check_split, in_val_split, model_device, pad_rows, register_task, rng_for
from qkv.tasks.options import check_options
from qkv.tasks.tokenizers import BOS, PAD, Tokenizer, WordTokenizer

OPS = ("[MAX", "[MIN", "[MED", "[SM")
CLOSE = "]"
DIGITS = tuple(str(d) for d in range(10))
MAX_TRIES = 1000


def apply_op(op: str, args: list[int]) -> int:
    if not args:
        raise ValueError(f"{op} needs at least one argument")
    if op == "[MAX":
        return max(args)
    if op == "[MIN":
        return min(args)
    if op == "[MED":
        s = sorted(args)
        mid = len(s) // 2
        return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) // 2
    if op == "[SM":
        return sum(args) % 10
    raise ValueError(f"unknown ListOps operator {op!r}")


def evaluate_expression(expr: str | list[str]) -> int:
    """Value of a ListOps expression, by a stack machine over the tokens (independent of the generator's
    recursive evaluation)."""
    tokens = expr.split() if isinstance(expr, str) else expr
    stack: list[Any] = []
    for tok in tokens:
        if tok in OPS:
            stack.append(tok)
        elif tok == CLOSE:
            args = []
            while stack and not (isinstance(stack[-1], str) and stack[-1] in OPS):
                args.append(stack.pop())
            if not stack:
                raise ValueError("unbalanced ']' in ListOps expression")
            stack.append(apply_op(stack.pop(), args))
        elif tok in DIGITS:
            stack.append(int(tok))
        else:
            raise ValueError(f"unknown ListOps token {tok!r}")
    if len(stack) != 1 or not isinstance(stack[0], int):
        raise ValueError("malformed ListOps expression")
    return stack[0]


@dataclass
class ListOpsOptions:
    min_len: int = setting(32, "shortest expression, in tokens (LRA: 500)", ge=1)
    max_len: int = setting(512, "longest expression, in tokens (LRA: 2000)", le=8192)
    max_depth: int = setting(10, "deepest nesting of operators", ge=1)
    max_args: int = setting(10, "most arguments of one operator", ge=2)
    leaf_prob: float = setting(0.25, "chance that a node (below max_depth) is a digit", ge=0, lt=1)
    seed: int = setting(0, "seeds the train/val batch streams and the evaluation set")
    val_fraction: float = setting(0.1, "share of the expressions (by hash) held out", gt=0, lt=1)

    def validate(self) -> None:
        check_options(self, ("min_len", "max_len"))


class ListOpsTask(Task):
    kinds = ("encoder",)
    metrics = {"accuracy": "max"}

    def __init__(self, options: ListOpsOptions, family: str, tokenizer: Tokenizer | None = None) -> None:
        self.options = options
        self.family = family
        self.tokenizer = tokenizer or WordTokenizer(OPS + (CLOSE,) + DIGITS)

    # -- generation ------------------------------------------------------------------------------------
    def _tree(self, rng: Any, depth: int, budget: int, out: list[str]) -> int:
        """Append a random subtree of at most `budget` tokens to `out`; return its value."""
        o = self.options
        if depth >= o.max_depth or budget < 4 or rng.random() < o.leaf_prob:
            d = rng.randrange(10)
            out.append(DIGITS[d])
            return d
        op = rng.choice(OPS)
        out.append(op)
        budget -= 2  # the operator and its ']'
        k = min(rng.randint(2, o.max_args), budget)
        values = []
        for i in range(k):
            left = k - i - 1  # children still to come need at least one token each
            share = max(1, (budget - left) // (left + 1))
            child_budget = min(budget - left, rng.randint(1, 2 * share))
            n0 = len(out)
            values.append(self._tree(rng, depth + 1, child_budget, out))
            budget -= len(out) - n0
        out.append(CLOSE)
        return apply_op(op, values)

    def example(self, rng: Any) -> tuple[str, int]:
        o = self.options
        for _ in range(MAX_TRIES):
            toks: list[str] = []
            value = self._tree(rng, 0, o.max_len, toks)
            if len(toks) >= o.min_len:
                return " ".join(toks), value
        raise ConfigError(f"could not generate a ListOps expression of at least min_len={o.min_len} tokens; "
                          "lower min_len or leaf_prob, or raise max_depth/max_args")

    def draw(self, rng: Any, split: str) -> tuple[str, int]:
        want_val = split == "val"
        for _ in range(MAX_TRIES):
            expr, value = self.example(rng)
            if in_val_split(expr, self.options.val_fraction) == want_val:
                return expr, value
        raise ConfigError(f"the {split} split of this ListOps space is (nearly) empty; change val_fraction")

    def examples(self, index: int, batch_size: int, split: str) -> list[tuple[str, int]]:
        rng = rng_for(self.options.seed, split, index, "listops")
        return [self.draw(rng, split) for _ in range(batch_size)]

    def eval_examples(self, n: int) -> list[tuple[str, int]]:
        rng = rng_for(self.options.seed, "val", 0, "listops/eval")
        return [self.draw(rng, "val") for _ in range(n)]

    # -- batches and evaluation ------------------------------------------------------------------------
    def collate(self, examples: list[tuple[str, int]]) -> dict[str, Tensor]:
        prefix = [BOS] if self.pools_first_token else []
        rows = [prefix + self.tokenizer.encode(e) for e, _ in examples]
        return {"input_ids": pad_rows(rows, PAD), "attention_mask": pad_rows([[1] * len(r) for r in rows], 0),
                "labels": torch.tensor([v for _, v in examples], dtype=torch.long)}

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, Tensor]:
        check_split(split)
        return self.collate(self.examples(index, batch_size, split))

    @property
    def pools_first_token(self) -> bool:
        """Does the model's classifier read the first position (BERT's [CLS]; <bos> plays it here)? A
        recurrent classifier reads its final states instead, and gets no such token."""
        return family_spec(self.family).model_class.pools_first_token

    def model_overrides(self, family: str | None = None) -> dict[str, Any]:
        self._check_family(family)
        return {"vocab_size": self.tokenizer.vocab_size,
                "context_length": self.options.max_len + self.pools_first_token, "num_labels": 10}

    @torch.no_grad()
    def predict(self, model: torch.nn.Module, examples: list[tuple[str, int]],
                batch_size: int = 64) -> list[int]:
        dev = model_device(model)
        was_training = model.training
        model.eval()
        preds: list[int] = []
        try:
            for b in range(0, len(examples), batch_size):
                batch = self.collate(examples[b:b + batch_size])
                logits = model(input_ids=batch["input_ids"].to(dev),
                               attention_mask=batch["attention_mask"].to(dev)).logits
                preds += logits.argmax(-1).tolist()
        finally:
            model.train(was_training)
        return preds

    def evaluate(self, model: torch.nn.Module, n: int = 500, batch_size: int = 64) -> dict[str, float]:
        """accuracy of the 10-way prediction on n held-out expressions (chance ~ the majority class)."""
        examples = self.eval_examples(n)
        preds = self.predict(model, examples, batch_size)
        right = sum(p == v for p, (_, v) in zip(preds, examples))
        return {"accuracy": right / max(1, len(examples)), "n": float(len(examples))}

    def generate_text(self, model: torch.nn.Module, prompt: str, **kwargs: Any) -> str:
        """The predicted value (a digit) of one expression."""
        return str(self.predict(model, [(prompt, 0)])[0])

    def samples(self, model: torch.nn.Module, n: int = 5) -> list[str]:
        examples = self.eval_examples(n)
        preds = self.predict(model, examples)
        out = []
        for (e, v), p in zip(examples, preds):
            shown = e if len(e) <= 80 else e[:77] + "..."
            out.append(f"{shown} -> {p}" + ("  (ok)" if p == v else f"  (expected {v})"))
        return out


def _factory(options: ListOpsOptions, family: str, tokenizer: Tokenizer | None = None) -> Task:
    return ListOpsTask(options, family, tokenizer)


register_task("listops", ListOpsOptions, _factory, ("encoder",),
              "ListOps (Long Range Arena): nested MAX/MIN/MED/SM expressions, 10-way classification",
              default_family="bert")
