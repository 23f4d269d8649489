"""No device-to-host synchronisation in the hot path: a forward pass and a decoding step trace into ONE graph
under torch.compile(fullgraph=True). Any `int(tensor)`, `bool(tensor)` or `.item()` on the way (the token-id
range check, masked attention's "is every row visible", RoPE's table size from a tensor offset) is a
data-dependent branch that Dynamo cannot trace, so it fails here; on a GPU each one stalls the device.
backend="eager" traces without compiling (no C++ toolchain needed)."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.nn.checks import check_token_ids


def fullgraph(fn):
    return torch.compile(fn, backend="eager", fullgraph=True)


def test_forward_with_padding_and_per_row_offsets_is_one_graph():
    for position in ("rope", "learned", "alibi"):
        m = qkv.build("gpt-nano", vocab_size=11, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2,
                      context_length=16, position=position).eval()
        ids = torch.randint(0, 11, (2, 6))
        mask = torch.ones(2, 6, dtype=torch.bool)
        mask[1, :2] = False
        with torch.no_grad():
            got = fullgraph(m)(ids, attention_mask=mask, offset=torch.tensor([0, -2])).logits
            torch.testing.assert_close(got, m(ids, attention_mask=mask, offset=torch.tensor([0, -2])).logits)


def test_decoding_step_and_encoder_decoder_are_one_graph():
    m = qkv.build("gpt-nano", vocab_size=11, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2,
                  position="rope").eval()
    ids = torch.randint(0, 11, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, :2] = False
    n_pad = torch.tensor([0, 2])
    with torch.no_grad():
        cache = m.make_cache(2, 12)
        m(ids, attention_mask=mask, cache=cache, offset=-n_pad)
        keep = torch.cat([mask, torch.ones(2, 1, dtype=torch.bool)], 1)
        assert fullgraph(m.step)(torch.tensor([[1], [2]]), cache, keep=keep,
                                 offset=cache.length - n_pad).shape == (2, 11)
        e = qkv.build("transformer-tiny", src_vocab_size=11, n_encoder_layers=1, n_decoder_layers=1,
                      d_model=32, n_heads=4).eval()
        src = torch.randint(3, 11, (2, 5))
        src_mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])
        assert fullgraph(e)(src, decoder_input_ids=src, attention_mask=src_mask).logits.shape == (2, 5, 11)


def test_token_ids_are_checked_where_they_enter():
    """A forward pass on CPU still checks the range (it costs no sync there); elsewhere the entry points do
    (generate, the Engine, the tokenizers), and check_token_ids(entry=True) always reads the range."""
    meta = torch.zeros(2, 3, dtype=torch.long, device="meta")
    check_token_ids(meta, 5)  # an accelerator-like device: the forward-pass check does not read the values
    ids = torch.tensor([[1, 7]])
    with pytest.raises(ValueError, match=r"token id 7, outside the vocabulary \[0, 5\)"):
        check_token_ids(ids, 5, entry=True)
    m = qkv.build("gpt-nano", vocab_size=5, n_layers=1, d_model=16, n_heads=2)
    for call in (lambda: m(ids), lambda: m.generate(ids, 2)):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            call()
