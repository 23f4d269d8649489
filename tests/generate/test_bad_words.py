"""bad_words_ids equals Hugging Face's NoBadWordsLogitsProcessor on the same ids and scores (one-token and
longer banned sequences; a lone eos is never banned), and the config validates it."""

import pytest
import torch

from qkv.config import ConfigError
from qkv.generate import GenerationConfig
from qkv.generate.processors import NoBadWords

hf = pytest.importorskip("transformers.generation.logits_process")


@pytest.mark.parametrize("words", [[[5]], [[5], [2]], [[3, 4], [7], [1, 2, 6]], [[9, 9]]])
def test_no_bad_words_equals_hf(words):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10, (6, 7), generator=g)
    ids[0, -1], ids[1, -2:] = 3, torch.tensor([1, 2])  # rows that end in a banned prefix
    ids[2, -1] = 9
    scores = torch.randn(6, 10, generator=g)
    ref = hf.NoBadWordsLogitsProcessor(words, eos_token_id=2)(ids, scores.clone())
    got = NoBadWords(words, [2])(ids, scores.clone())
    assert torch.equal(got, ref)


def test_bad_words_ids_is_validated():
    assert GenerationConfig(bad_words_ids=[[1], [2, 3]]).bad_words_ids == [[1], [2, 3]]
    for bad in ([], [[]], [[-1]]):
        with pytest.raises(ConfigError, match="bad_words_ids"):
            GenerationConfig(bad_words_ids=bad)
