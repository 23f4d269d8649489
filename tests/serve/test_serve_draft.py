"""qkv serve with --speculative DRAFT_FOLDER (EngineConfig.speculative as a model folder): a small model of
the same tokenizer drafts for every request. Through the official openai client on a loopback port, a
concurrent batch of prompts, streamed and not, answers exactly as the server without it (greedy), and the
drafts move the engine's stats; the draft is loaded as the served model; a draft folder of another
vocabulary, or one that does not exist, is refused in one line (exit 2) before the server listens."""

from __future__ import annotations

import shutil

import pytest
import torch
from _servehelpers import greedy_completions, running_server

from qkv.cli.main import main
from qkv.config import ConfigError
from qkv.serve import build_engine, load_served

transformers = pytest.importorskip("transformers")

PROMPTS = ["def f(x):\n    return x\ndef f(x):\n", "The class", "import", "An object is an object is",
           "for i in range(10): for i in", "x"]
MAX_TOKENS = (20, 14, 16, 20, 16, 10)


def _gpt2(path, vocab: int, seed: int, layers: int):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=96, n_embd=32, n_layer=layers, n_head=2,
                                  bos_token_id=0, eos_token_id=4, initializer_range=0.3)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(gpt2_folder, tmp_path_factory):
    """(draft, other): a 1-layer GPT-2 of the served folder's tokenizer, and one whose tokenizer has another
    vocabulary (trained on other text)."""
    from tokenizers import ByteLevelBPETokenizer

    root = tmp_path_factory.mktemp("drafts")
    draft = root / "draft"
    draft.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gpt2_folder / name, draft / name)
    vocab = load_served(gpt2_folder).model.output_vocab_size
    _gpt2(draft, vocab, seed=1, layers=1)
    other = root / "other"
    other.mkdir()
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["another text, another vocabulary"] * 20, vocab_size=300, min_frequency=1,
                            special_tokens=["<|endoftext|>", "<|end|>"])
    bpe.save(str(other / "tokenizer.json"))
    shutil.copy(gpt2_folder / "tokenizer_config.json", other / "tokenizer_config.json")
    _gpt2(other, bpe.get_vocab_size(), seed=1, layers=1)
    return draft, other


def test_a_draft_model_server_answers_as_the_plain_server(gpt2_folder, folders):
    draft, _ = folders
    name = load_served(gpt2_folder).name
    with running_server(gpt2_folder, block_size=4, max_batch_size=4) as (url, _app):
        want = greedy_completions(url, name, PROMPTS, MAX_TOKENS, stream=False)
    assert any(want)
    with running_server(gpt2_folder, block_size=4, max_batch_size=4, speculative=str(draft),
                        speculative_tokens=3) as (url, app):
        engine = app.state.api.engine
        assert engine.drafter.model is not None
        assert greedy_completions(url, name, PROMPTS, MAX_TOKENS, stream=False) == want
        assert greedy_completions(url, name, PROMPTS, MAX_TOKENS, stream=True) == want
        stats = engine.stats()
        assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
        assert stats["blocks_used"] == 0 and engine.drafter.requests == set()


def test_the_served_folder_drafting_for_itself_accepts_every_draft(gpt2_folder):
    served = load_served(gpt2_folder)
    engine = build_engine(served, block_size=4, speculative=str(gpt2_folder), speculative_tokens=4)
    rids = [engine.add_request(served.codec.encode(p), max_new_tokens=n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    plain = build_engine(served, block_size=4)
    want = [plain.add_request(served.codec.encode(p), max_new_tokens=n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    out, ref = engine.run(), plain.run()
    assert [out[r] for r in rids] == [ref[r] for r in want]
    assert engine.stats()["spec_acceptance_rate"] == 1.0 and engine.stats()["spec_draft_tokens"] > 0


def test_the_draft_is_loaded_as_the_served_model(gpt2_folder, folders):
    """The served model's floating dtype (and device) is the draft's: its cache and logits match."""
    served = load_served(gpt2_folder)
    served.model.to(torch.bfloat16)
    engine = build_engine(served, block_size=4, speculative=str(folders[0]))
    assert next(engine.drafter.model.parameters()).dtype == torch.bfloat16
    assert engine.drafter.cache.k.dtype == torch.bfloat16


def test_a_draft_of_another_vocabulary_or_missing_is_refused(gpt2_folder, folders, tmp_path, capsys):
    _, other = folders
    with pytest.raises(ConfigError, match="same tokenizer"):
        build_engine(load_served(gpt2_folder), speculative=str(other))
    for bad, words in ((other, "same tokenizer"), (tmp_path / "nowhere", "no such draft model folder")):
        assert main(["serve", str(gpt2_folder), "--port", "0", "--speculative", str(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("qkv: error:") and words in err and "\n" not in err
