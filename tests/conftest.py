"""Shared fixtures: every test starts from the same random state, so failures reproduce.

Tests use tiny tensors, for which intra-op threads cost far more than they bring (on the shared 2-core
CI machine a 2-layer forward took 0.3 s with 2 threads and 3 ms with 1); parallelism comes from
`pytest -n 2` instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
# the commands and servers the tests start run beside the other worker on the same cores: oversubscribed,
# where spinning OpenMP threads wait on threads that are not running (README: a busy or shared CPU)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def torchrun():
    """Run `torchrun --standalone --nproc_per_node=2 ARGS` (gloo, CPU, one thread a rank) and return the
    CompletedProcess, failing the test unless it exits 0.

    gloo's TCP transport now and then aborts a rank (SIGABRT, "Connection reset by peer" on the other; seen
    once in CI on a loaded 2-core machine, never in 99 runs here, 40 of them with the cores hogged;
    pytorch/gloo#168). A run in which a rank died of a signal is run once more, with a warning in the test
    summary; a rank that fails in Python (exit code 1: a wrong value, an exception), or a second crash, fails
    the test. The failure message keeps the start of every rank's error as well as the end of the output, so
    the first error is never cut off.
    """
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("torchrun not found next to the python executable")

    def run(args: list[str], timeout: int = 600, cwd=None) -> subprocess.CompletedProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        cmd = [exe, "--standalone", "--nproc_per_node=2", *map(str, args)]
        for attempt in (1, 2):
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
            # torchrun's summary names the first rank to fail; a negative exit code is a signal (a crash)
            crashed = ("Root Cause" in r.stderr
                       and re.search(r"exitcode\s*:\s*-\d", r.stderr.split("Root Cause")[-1]))
            if r.returncode == 0 or not crashed or attempt == 2:
                break
            warnings.warn(f"torchrun: a rank died of a signal; running once more:\n{_first_errors(r.stderr)}",
                          stacklevel=2)
        assert r.returncode == 0, (f"torchrun exit {r.returncode}\n-- first errors "
                                   f"--\n{_first_errors(r.stderr)}\n-- stdout tail "
                                   f"--\n{r.stdout[-2000:]}\n-- stderr tail --\n{r.stderr[-3000:]}")
        return r

    return run


def _first_errors(stderr: str, context: int = 6) -> str:
    """Each distinct error line of a torchrun log (rank tracebacks' last lines, C++ aborts) with a few lines
    before it: the cause, which the tail of a long log leaves out."""
    lines = stderr.splitlines()
    keys = ("Error", "error:", "terminate called", "what():", "Signal ", "Aborted", "exitcode")
    picked, seen = [], set()
    for i, line in enumerate(lines):
        if any(k in line for k in keys) and line.strip() not in seen:
            seen.add(line.strip())
            picked.extend(lines[max(0, i - context):i + 1] + ["..."])
    return "\n".join(picked[-200:])[:8000]


@pytest.fixture(scope="session")
def llama_sp(tmp_path_factory):
    """A tiny random Llama folder with a SentencePiece-style tokenizer (Metaspace, prepend_scheme="first",
    byte fallback, bos added by the post-processor), as converted Llama-2 / Mistral / TinyLlama folders have:
    (folder, the tokenizers.Tokenizer, the transformers model). The head scores only word-start ("▁...")
    tokens, so every generated token begins with a space: the one a decoder drops at the start of a text."""
    import json
    import pydoc_data.topics

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    folder = tmp_path_factory.mktemp("llama_sp")
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(list(pydoc_data.topics.topics.values())[:60], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True}), encoding="utf-8")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1,
                                   eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for i in range(cfg.vocab_size):
            if not tok.id_to_token(i).startswith("▁") or len(tok.id_to_token(i)) < 2:
                model.lm_head.weight[i] = 0.0
    model.save_pretrained(folder)
    return folder, tok, model
