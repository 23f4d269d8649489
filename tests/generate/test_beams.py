"""generate/beams.py on hand-made candidates: an eos among the K best closes a hypothesis (scored
S / L**length_penalty), the next K non-eos candidates become the beams, and when an input is done."""

from __future__ import annotations

import torch

from qkv.generate.beams import BeamBook
from qkv.generate.config import GenerationConfig


def _book(**cfg) -> BeamBook:
    return BeamBook(1, GenerationConfig(num_beams=2, **cfg), max_new=5, eos={0}, pad=9)


def test_eos_closes_a_hypothesis_and_the_open_beams_follow():
    book = _book(length_penalty=1.0)
    generated = torch.tensor([[5, 6], [7, 8]])  # the two beams' tokens so far
    nxt = book.advance([[-1.0, -2.0, -3.0, -4.0]], [[1, 0, 0, 1]], [[0, 3, 4, 0]], 2, generated, 3)
    (score, toks), = book.finished[0]
    assert score == -1.0 / 3 and toks.tolist() == [7, 8, 0]  # beam 1's tokens, then eos
    assert nxt.scores.tolist() == [[-2.0, -3.0]] and nxt.tokens.tolist() == [[3, 4]]
    assert nxt.sources.tolist() == [[0, 0]] and book.done == [False]


def test_an_eos_outside_the_k_best_is_dropped_and_empty_slots_score_minus_infinity():
    book = _book()
    nxt = book.advance([[-1.0, -2.0, -3.0]], [[0, 0, 0]], [[4, 5, 0]], 1, torch.tensor([[5]]), 1)
    assert book.finished == [[]] and nxt.tokens.tolist() == [[4, 5]]
    nxt = _book().advance([[-1.0, float("-inf")]], [[0, 0]], [[4, 6]], 1, torch.tensor([[5]]), 1)
    assert nxt.tokens.tolist() == [[4, 9]] and nxt.scores[0, 1] == float("-inf")
    assert nxt.sources.tolist() == [[0, 0]]


def test_when_an_input_is_done():
    done_early = _book(early_stopping=True)
    done_early.advance([[-1.0, -1.5, -2.0, -9.0]], [[0, 1, 0, 0]], [[0, 0, 3, 4]], 2,
                       torch.tensor([[1], [2]]), 2)
    assert len(done_early.finished[0]) == 2 and done_early.done == [True]  # K finished hypotheses
    never = _book(early_stopping="never", length_penalty=1.0)
    never.advance([[-1.0, -1.5, -2.0, -9.0]], [[0, 1, 0, 0]], [[0, 0, 3, 4]], 2, torch.tensor([[1], [2]]), 2)
    # the worst finished scores -1.5 / 2; the best open beam (-2.0) can reach at best -2.0 / 5: not done
    assert never.done == [False]


def test_close_and_best_pad_each_inputs_hypotheses():
    book = _book(length_penalty=1.0, num_return_sequences=2)
    book.finished[0].append((-0.5, torch.tensor([3, 0])))
    book.close(torch.tensor([[-3.0, float("-inf")]]), torch.tensor([[4, 5, 6], [7, 8, 9]]))
    tokens, scores = book.best(torch.device("cpu"))
    assert tokens.tolist() == [[3, 0, 9], [4, 5, 6]] and scores.tolist() == [-0.5, -1.0]
