"""Stack.forward(unpad=True): the token-wise layers run on the real tokens' rows only (attention.Unpadded).
On the real tokens it is the padded computation's function, forward and backward, for every position
encoding hook (learned table, RoPE's rotation, ALiBi's bias), causal or not, and for BatchNorm, whose
training statistics must ignore padding in both layouts."""

from __future__ import annotations

import copy

import pytest
import torch

import qkv
from qkv.nn.attention import Unpadded


def test_unpadded_pad_and_unpad_round_trip():
    keep = torch.tensor([[1, 1, 0], [0, 1, 1]]).bool()
    u = Unpadded.from_keep(keep)
    x = torch.arange(12.0).view(2, 3, 2)
    rows = u.unpad(x)
    torch.testing.assert_close(rows, x[keep])
    back = u.pad(rows)
    torch.testing.assert_close(back[keep], x[keep])
    assert back[~keep].abs().max() == 0


@pytest.mark.parametrize("kw", [dict(position="learned"), dict(position="rope", norm="batchnorm"),
                                dict(position="alibi", placement="post")],
                         ids=["learned", "rope-bn", "alibi-post"])
def test_unpadded_stack_equals_padded_on_real_tokens(kw):
    torch.manual_seed(0)
    m = qkv.build("gpt-nano", vocab_size=17, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2,
                  context_length=16, **kw).train()
    ref = copy.deepcopy(m)
    x = torch.randn(3, 7, 32)
    keep = torch.ones(3, 7, dtype=torch.bool)
    keep[1, 5:] = False  # right padding
    keep[2, :3] = False  # left padding
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = m.decoder(xa, keep=keep, unpad=True).hidden
    want = ref.decoder(xb, keep=keep).hidden
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)
    assert got[~keep].abs().max() == 0
    (got[keep] ** 2).sum().backward()
    (want[keep] ** 2).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, atol=1e-5, rtol=1e-4)
    for (n, a), b in zip(m.named_parameters(), ref.parameters()):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=n)
