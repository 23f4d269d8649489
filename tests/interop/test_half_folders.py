"""A bf16 or fp16 Hugging Face folder keeps its dtype in every family (as transformers loads it): the loaded
weights are the file's bits, and the model computes what the fp32 copy of the same weights computes, to half
precision."""

from __future__ import annotations

import pytest
import torch
from _seq2seq_models import V, bart, t5
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

import qkv  # noqa: E402


def _gpt2(folder):
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)


def _bert(folder):
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=48, max_position_embeddings=32)
    transformers.BertForMaskedLM(cfg).save_pretrained(folder)


FAMILIES = {"gpt2": _gpt2, "bert": _bert, "t5": t5, "bart": bart}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_half_folder_keeps_its_dtype(tmp_path, family, dtype):
    torch.manual_seed(0)
    FAMILIES[family](tmp_path / "fp32")
    hf = getattr(transformers, "AutoModelForSeq2SeqLM" if family in ("t5", "bart") else
                 "AutoModelForMaskedLM" if family == "bert"
                     else "AutoModelForCausalLM").from_pretrained(tmp_path / "fp32")
    hf.to(dtype).save_pretrained(tmp_path / "half")
    full = qkv.from_pretrained(tmp_path / "fp32")
    half = qkv.from_pretrained(tmp_path / "half")
    assert {p.dtype for p in half.parameters()} == {dtype}
    assert {p.dtype for p in full.parameters()} == {torch.float32}
    # the file's bits, not an fp32 round trip: every half weight equals the fp32 model's weight rounded once
    file = load_file(str(tmp_path / "half" / "model.safetensors"))
    assert all(t.dtype == dtype for t in file.values() if t.is_floating_point())
    for (name, p), q in zip(half.named_parameters(), full.parameters()):
        assert torch.equal(p, q.to(dtype)), name
    ids = torch.randint(2, V, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        if family in ("t5", "bart"):
            a = full(ids, decoder_input_ids=ids[:, :6]).logits
            b = half(ids, decoder_input_ids=ids[:, :6]).logits
        else:
            a, b = full(ids).logits, half(ids).logits
    assert b.dtype == dtype
    torch.testing.assert_close(b.float(), a, atol=0.1 * a.abs().max().item(), rtol=0.05)
