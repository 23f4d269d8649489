"""Tiny models to explore, built once per test session (per xdist worker), all offline:

  rev_run      a qkv run folder: the reverse task on an encoder-decoder, trained for a few steps
  charlm_run   a qkv run folder: a character-level GPT on Python's bundled docs, a few steps
  hf_gpt2      a Hugging Face GPT-2 folder with random weights (transformers) and a byte-level BPE
               tokenizer.json trained here on a stdlib text
  app_for      FastAPI TestClient for a model folder
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from _exploremodels import N_EMBD, N_HEAD, N_LAYER, N_POSITIONS


def _train(out: Path, config: str, overrides: list[str]) -> Path:
    from qkv.run import load_run_config, train_run

    cfg = load_run_config(config, overrides + ["train.progress=false", "train.log_every=100", "eval.n=8",
                                               "eval.samples=0", "train.eval_every=0"])
    train_run(cfg, out=out, quiet=True)
    return out


@pytest.fixture(scope="session")
def rev_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("explore") / "rev"
    return _train(out, "reverse",
                  ["train.max_steps=6", "task.min_len=4", "task.max_len=8", "model.d_model=32",
                                   "model.d_ff=64"])


@pytest.fixture(scope="session")
def charlm_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("explore") / "charlm"
    return _train(out, "charlm",
                  ["train.max_steps=3", "task.context=32", "model.n_layers=2", "model.d_model=32",
                                  "model.n_heads=2", "train.batch_size=4"])


@pytest.fixture(scope="session")
def hf_gpt2(tmp_path_factory) -> Path:
    transformers = pytest.importorskip("transformers")
    from tokenizers import ByteLevelBPETokenizer

    folder = tmp_path_factory.mktemp("explore") / "hf-gpt2"
    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator([inspect.getsource(inspect)], vocab_size=300, min_frequency=2,
                            show_progress=False)
    vocab = bpe.get_vocab_size()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=N_EMBD, n_layer=N_LAYER, n_head=N_HEAD,
                                  n_positions=N_POSITIONS, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # HF init is nearly uniform attention; spread the weights so maps have structure
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    bpe._tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="session")
def clients():
    """TestClient per model folder, loaded once."""
    from fastapi.testclient import TestClient

    from qkv.explore import create_app, load

    made: dict[str, TestClient] = {}

    def get(folder: Path) -> TestClient:
        key = str(folder)
        if key not in made:
            made[key] = TestClient(create_app(load(folder)), raise_server_exceptions=False)
        return made[key]

    return get
