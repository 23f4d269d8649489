"""ListOps: operator semantics on hand-checked expressions, generator labels vs an independent evaluator,
length/depth limits, batches for bert and lstm, split, evaluation against an oracle."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qkv.models.base import ModelOutput
from qkv.tasks import build_task
from qkv.tasks.listops import evaluate_expression
from qkv.tasks.tokenizers import BOS, PAD

HAND = [
    # the LRA paper's example (MED 1 5 8 9 2 = 5; MIN 2 3 = 2; MAX 4 3 2 1 0 5 = 5)
    ("[MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]", 5),
    ("[MIN 7 [MAX 1 2 ] 9 ]", 2),
    ("[SM 5 6 7 ]", 8),  # 18 mod 10
    ("[MED 1 2 ]", 1),  # even count: mean of the middle two (1.5), rounded down
    ("[MED 3 9 8 1 ]", 5),  # sorted 1 3 8 9: (3 + 8) // 2
    ("[SM [MAX 9 9 ] [MIN 9 8 ] 3 ]", 0),  # 9 + 8 + 3 = 20
    ("7", 7),
]


def _python_eval(tokens: list[str]) -> tuple[int, int]:
    """Recursive-descent evaluation (a second, independent implementation): (value, tokens consumed)."""
    tok = tokens[0]
    if tok.isdigit():
        return int(tok), 1
    i, args = 1, []
    while tokens[i] != "]":
        v, n = _python_eval(tokens[i:])
        args.append(v)
        i += n
    s = sorted(args)
    value = {"[MAX": max(args), "[MIN": min(args), "[SM": sum(args) % 10,
             "[MED": s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) // 2}[tok]
    return value, i + 1


def _depth(tokens: list[str]) -> int:
    d = best = 0
    for t in tokens:
        d += t.startswith("[")
        d -= t == "]"
        best = max(best, d)
    return best


@pytest.mark.parametrize("expr,value", HAND)
def test_hand_checked_expressions(expr, value):
    assert evaluate_expression(expr) == value
    assert _python_eval(expr.split())[0] == value


def test_malformed_expressions_are_errors():
    for bad in ["[MAX 1 2", "1 2", "[FOO 1 ]", "]"]:
        with pytest.raises(ValueError):
            evaluate_expression(bad)


@pytest.mark.parametrize("opts", [dict(), dict(min_len=200, max_len=600, max_depth=4, max_args=5)])
def test_generator_labels_lengths_and_depth(opts):
    task = build_task("listops", **opts)
    o = task.options
    examples = task.examples(0, 64, "train") + task.eval_examples(32)
    for expr, value in examples:
        toks = expr.split()
        assert o.min_len <= len(toks) <= o.max_len
        assert _depth(toks) <= o.max_depth
        assert evaluate_expression(expr) == _python_eval(toks)[0] == value
    assert len({v for _, v in examples}) >= 5  # labels are spread over the classes


def test_long_sequences_up_to_2k():
    task = build_task("listops", min_len=1000, max_len=2000)
    lengths = [len(e.split()) for e, _ in task.examples(0, 8, "train")]
    assert min(lengths) >= 1000 and max(lengths) <= 2000


@pytest.mark.parametrize("family", ["bert", "lstm"])
def test_batches(family):
    task = build_task("listops", family=family, max_len=128, min_len=16)
    examples = task.examples(3, 8, "train")
    b = task.batch(3, 8)
    assert b["labels"].shape == (8,) and b["labels"].tolist() == [v for _, v in examples]
    ids, mask = b["input_ids"], b["attention_mask"]
    for i, (expr, _) in enumerate(examples):
        row = ids[i][mask[i].bool()].tolist()
        if family == "bert":
            assert row[0] == BOS  # the CLS position the pooler reads
            row = row[1:]
        assert task.tokenizer.decode(row) == expr
    assert bool((ids[~mask.bool()] == PAD).all())
    assert ids.shape[1] <= task.model_overrides()["context_length"]
    preset = "bert-tiny" if family == "bert" else "bilstm-classify"
    model = task.build_model(preset)
    out = model(**b)
    assert out.logits.shape == (8, 10) and torch.isfinite(out.loss)


def test_split_disjoint_and_deterministic():
    task = build_task("listops", max_len=24, min_len=4, max_depth=2, max_args=3, val_fraction=0.3)
    train = {e for i in range(30) for e, _ in task.examples(i, 32, "train")}
    val = {e for i in range(10) for e, _ in task.examples(i, 32, "val")}
    assert train and val and not train & val
    assert task.examples(5, 4, "train") == build_task("listops", max_len=24, min_len=4, max_depth=2,
                                                      max_args=3, val_fraction=0.3).examples(5, 4, "train")


class Oracle(nn.Module):
    """Classifies by evaluating the decoded expression: accuracy must be 1."""

    def __init__(self, task) -> None:
        super().__init__()
        self.task = task
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, **_):
        logits = torch.zeros(input_ids.shape[0], 10)
        for b in range(input_ids.shape[0]):
            row = input_ids[b][attention_mask[b].bool()].tolist()
            logits[b, evaluate_expression(self.task.tokenizer.decode(row))] = 1.0
        return ModelOutput(logits=logits)


@pytest.mark.parametrize("family", ["bert", "lstm"])
def test_evaluate_with_an_oracle(family):
    task = build_task("listops", family=family, max_len=64, min_len=8)
    assert task.evaluate(Oracle(task), n=40) == {"accuracy": 1.0, "n": 40.0}
    lines = task.samples(Oracle(task), n=2)
    assert all(line.endswith("(ok)") for line in lines)
    assert task.generate_text(Oracle(task), "[SM 5 6 7 ]") == "8"
