"""Language-modelling task: corpus, split, windows, evaluation against closed forms, samples, errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from qkv.config import ConfigError
from qkv.models.base import ModelOutput, token_loss
from qkv.tasks import build_task, load_task
from qkv.tasks.lm import default_corpus


class Uniform(nn.Module):
    """Predicts every token with probability 1/V: its loss is ln V whatever the text."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, labels=None, **_):
        logits = torch.zeros(*input_ids.shape, self.vocab) + self.w
        loss, n = token_loss(logits[:, :-1], labels[:, 1:])
        return ModelOutput(logits=logits, loss=loss, n_targets=n)


def test_default_corpus_is_pydoc_topics_in_sorted_key_order():
    from pydoc_data.topics import topics

    text = default_corpus()
    assert 300_000 < len(text) < 700_000
    first = sorted(topics)[0]
    assert text.startswith(topics[first]) and text.endswith(topics[sorted(topics)[-1]])


@pytest.fixture(scope="module")
def charlm():
    return build_task("charlm", context=32)


def test_char_split_and_windows(charlm):
    text = default_corpus()
    cut = int(len(text) * 0.9)
    tok = charlm.tokenizer
    assert len(charlm.data["train"]) == cut and len(charlm.data["val"]) == len(text) - cut
    assert tok.decode(charlm.data["val"][:50]) == text[cut:cut + 50]
    b = charlm.batch(11, 6)
    assert set(b) == {"input_ids", "labels"} and b["input_ids"].shape == (6, 32)
    assert torch.equal(b["input_ids"], b["labels"])  # the model shifts
    for row in b["input_ids"]:
        assert tok.decode(row) in text[:cut]  # a contiguous window of the train split
    for row in charlm.batch(11, 6, "val")["input_ids"]:
        assert tok.decode(row) in text[cut:]
    assert torch.equal(charlm.batch(11, 6)["input_ids"],
                       build_task("charlm", context=32).batch(11, 6)["input_ids"])
    assert not torch.equal(charlm.batch(11, 6)["input_ids"], charlm.batch(12, 6)["input_ids"])
    over = charlm.model_overrides()
    assert over == {"vocab_size": tok.vocab_size, "context_length": 32}


def test_evaluate_against_the_uniform_closed_form(charlm):
    V = charlm.tokenizer.vocab_size
    res = charlm.evaluate(Uniform(V))
    assert res["val_loss"] == pytest.approx(math.log(V), rel=1e-6)
    assert res["perplexity"] == pytest.approx(V, rel=1e-5)
    assert res["bpc"] == pytest.approx(math.log2(V), rel=1e-6)
    # tiling, stride 31
    assert res["n_tokens"] == len(charlm.data["val"]) - 1 - (len(charlm.data["val"]) - 1) % 31
    assert charlm.evaluate(Uniform(V), n=10)["n_tokens"] == 10 * 31


def test_bpe_lm_bits_per_character(tmp_path):
    text = ("The quick brown fox jumps over the lazy dog. " * 400
            + "Pack my box with five dozen liquor jugs. " * 400)
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    task = build_task("bpelm", path=str(path), bpe_vocab_size=300, context=16)
    V = task.tokenizer.vocab_size
    assert task.chars_per_token > 1.3  # 38 merges learned on the train split
    cut = int(len(text) * 0.9)
    assert task.tokenizer.decode(task.data["val"]) == text[cut:]
    res = task.evaluate(Uniform(V))
    # bits per character = bits per token / characters per token
    assert res["bpc"] == pytest.approx(math.log2(V) * len(task.data["val"]) / len(text[cut:]), rel=1e-6)
    for row in task.batch(0, 4)["input_ids"]:
        assert task.tokenizer.decode(row) in text[:cut]
    task.save(tmp_path / "run")
    again = load_task(tmp_path / "run")
    assert again.tokenizer.hf.to_str() == task.tokenizer.hf.to_str()
    assert torch.equal(again.batch(3, 4)["input_ids"], task.batch(3, 4)["input_ids"])
    path.unlink()  # the text is gone: the saved tokenizer still generates; batches/evaluate say why not
    gone = load_task(tmp_path / "run")
    model = gone.build_model("gpt-nano")
    assert gone.generate_text(model, "The quick", max_new_tokens=5).startswith("The quick")
    with pytest.raises(ConfigError, match="not found"):
        gone.batch(0, 2)
    with pytest.raises(ConfigError, match="not found"):
        gone.evaluate(model)


@pytest.mark.parametrize("family,preset", [("gpt", "gpt-nano"), ("lstm", "lstm-tiny")])
def test_models_train_a_step_and_sample(charlm, family, preset):
    task = build_task("charlm", family=family, context=32, sample_tokens=40)
    model = task.build_model(preset, d_model=48)
    out = model(**task.batch(0, 4))
    assert torch.isfinite(out.loss) and int(out.n_targets) == 4 * 31
    out.loss.backward()
    samples = task.samples(model, n=2)
    assert len(samples) == 2 and all(s.startswith("\n") for s in samples)
    assert samples[0] != samples[1]
    assert task.samples(model, n=2) == samples  # seeded
    long = task.generate_text(model, "def ", max_new_tokens=70)  # longer than the context: slides
    assert long.startswith("def ") and len(long) > 32
    greedy = task.generate_text(model, "def ", max_new_tokens=10, greedy=True)
    assert greedy == task.generate_text(model, "def ", max_new_tokens=10, greedy=True, seed=123)


def test_lm_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        build_task("charlm", path=str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        build_task("charlm", path=str(tmp_path / "empty.txt"))
    (tmp_path / "short.txt").write_text("abc" * 10)
    with pytest.raises(ConfigError, match="fewer than one window"):
        build_task("charlm", path=str(tmp_path / "short.txt"), context=16)
    with pytest.raises(ConfigError, match="task.tokenizer: 'wordpiece' is not one of \\['char', 'bpe'\\]"):
        build_task("lm", tokenizer="wordpiece")
    with pytest.raises(ConfigError, match="supports model families"):
        build_task("charlm", family="encdec")


def test_sampling_options_follow_generation_configs_rule():
    """task.temperature / task.top_k take GenerationConfig's rule, as `qkv generate`, `qkv chat` and the
    server: temperature 0 samples greedily, top_k 0 is no top-k; below those bounds is an error."""
    torch.manual_seed(0)
    greedy_task = build_task("charlm", context=32, sample_tokens=12)
    model = greedy_task.build_model("gpt-nano", d_model=32, n_heads=2, n_layers=1, init_std=0.3)
    greedy = greedy_task.samples(model, n=2, greedy=True)
    assert build_task("charlm", context=32, sample_tokens=12, temperature=0).samples(model, n=2) == greedy
    sampled = build_task("charlm", context=32, sample_tokens=12).samples(model, n=2)
    assert sampled != greedy  # the comparison above means something
    assert build_task("charlm", context=32, sample_tokens=12, top_k=0).samples(model, n=2) == sampled
    for bad, words in (({"temperature": -0.5}, "temperature must be at least 0"),
                       ({"top_k": -1}, "top_k must be at least 0")):
        with pytest.raises(ConfigError, match=words):
            build_task("charlm", context=32, **bad)
