"""Helpers shared by the speedrun tests: a tiny qkv run pretrained here with a byte-level BPE, and the checks
every chat model folder qkv makes must pass (qkv chat, qkv serve through the openai client, qkv explore, qkv
export -> transformers with equal logits and equal greedy text)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS / "serve") not in sys.path:  # the server the serve tests start (uvicorn on 127.0.0.1)
    sys.path.insert(0, str(TESTS / "serve"))

LLAMA_SHAPE = {"family": "gpt", "d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1,
               "position": "rope", "norm": "rmsnorm", "ffn": "swiglu", "bias": False, "init_std": 0.1}
QUESTION = "Who are you?"
ANSWER = "I am qkv."


def pretrain_tiny(folder: Path, text_file: Path, steps: int = 5) -> Path:
    """`qkv train` of a 2-layer Llama-shaped GPT with a byte-level BPE (task lm) on `text_file`."""
    from qkv.run import train_run

    cfg = {"model": dict(LLAMA_SHAPE),
           "task": {"name": "lm", "path": str(text_file), "tokenizer": "bpe", "bpe_vocab_size": 300,
                    "context": 64},
           "train": {"max_steps": steps, "batch_size": 4, "lr": 3e-3, "progress": False, "plot": False,
                     "tensorboard": False, "log_every": 1},
           "eval": {"n": 2, "samples": 0}}
    train_run(cfg, folder, quiet=True)
    return folder


def write_chats(path: Path, copies: int = 8) -> Path:
    rows = [{"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]}
            ] * copies
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def check_export_parity(chat: Path, hf_out: Path) -> None:
    """`qkv export` of `chat`; transformers loads it with its tokenizer: the chat template renders the same
    ids, the logits are equal, greedy decoding gives the same tokens and text."""
    import transformers

    from qkv import from_pretrained
    from qkv.cli.main import main
    from qkv.generate import generate
    from qkv.interop.tokenizer import load_hf_tokenizer

    assert main(["export", str(chat), str(hf_out)]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_out).eval()
    assert hf.config.model_type == "llama"
    messages = [{"role": "user", "content": QUESTION}]
    ids = load_hf_tokenizer(chat).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == list(ref)
    x = torch.tensor([ids])
    ours = from_pretrained(chat).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x).logits, atol=1e-5, rtol=1e-5)
    mine = generate(ours, x, max_new_tokens=8, do_sample=False, eos_token_id=None)
    theirs = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, min_new_tokens=8,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    assert mine.tolist() == theirs.tolist()
    assert hf_tok.decode(theirs[0, len(ids):]) == load_hf_tokenizer(chat).decode(mine[0, len(ids):].tolist())


def check_serve(chat: Path) -> str:
    """qkv serve of `chat` answers the official openai client, whole and streamed, alike (greedy)."""
    import openai
    from _servehelpers import running_server

    with running_server(chat) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": QUESTION}]
        whole = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0, stream=True) if c.choices]
    text = whole.choices[0].message.content
    assert "".join(pieces) == text
    return text


def check_explore(chat: Path) -> None:
    """qkv explore loads `chat` and draws causal attention maps whose rows sum to one."""
    from fastapi.testclient import TestClient

    from qkv.explore import create_app, load

    client = TestClient(create_app(load(chat)), raise_server_exceptions=False)
    r = client.post("/api/analyze", json={"input": "def add(a, b):"})
    assert r.status_code == 200, r.text
    [view] = r.json()["views"]
    assert view["causal"] is True
    maps = torch.tensor(view["layers"], dtype=torch.float64)
    torch.testing.assert_close(maps.sum(-1), torch.ones(maps.shape[:-1], dtype=torch.float64), atol=1e-3,
                               rtol=0)
