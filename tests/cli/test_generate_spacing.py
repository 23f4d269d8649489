"""`qkv generate` on a SentencePiece-style (Metaspace, prepend_scheme="first") Hugging Face folder, as
converted Llama-2 / Mistral / TinyLlama folders have: the continuation keeps the space before its first word,
plain and --stream ("Hello con ar", not "Hellocon ar"), as the `tokenizers` decode of prompt + continuation
has it."""

from __future__ import annotations

import pytest
import torch

from qkv.cli.main import main

transformers = pytest.importorskip("transformers")

MAX_NEW = 8


def _reference(llama_sp, prompt: str) -> str:
    """What transformers' greedy generation adds after the prompt, by the `tokenizers` decode of the whole."""
    _, tok, model = llama_sp
    ids = tok.encode(prompt).ids
    assert ids[0] == 1  # <s>
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                             do_sample=False,
                             pad_token_id=2)[0].tolist()
    assert len(out) == len(ids) + MAX_NEW
    head = tok.decode(ids, skip_special_tokens=True)
    full = tok.decode(out, skip_special_tokens=True)
    assert head == prompt and full.startswith(head)
    return full[len(head):]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("prompt", ["Hello", "The class of"])
def test_continuation_keeps_its_leading_space(llama_sp, prompt, stream, capsys):
    want = _reference(llama_sp, prompt)
    assert want.startswith(" ") and want.strip()  # the case that lost its space: a word-start token first
    args = ["generate", str(llama_sp[0]), "--prompt", prompt, "--max-new-tokens", str(MAX_NEW), "--greedy"]
    assert main(args + (["--stream"] if stream else [])) == 0
    assert capsys.readouterr().out == prompt + want + "\n"
