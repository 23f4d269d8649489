"""Pre-LN and Post-LN blocks against hand-written references of the two formulas, built from the
block's own sub-modules used as plain functions (dropout 0)."""

from __future__ import annotations

import pytest
import torch

from qkv.nn.block import Block
from qkv.nn.position import ALiBi, RoPE


def randomize(m):
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def reference(block: Block, x, *, mask=None, bias=None, memory=None, memory_mask=None, position=None):
    attn = lambda h: block.attn(h, mask=mask, bias=bias, position=position)[0]  # noqa: E731
    cross = lambda h: block.cross(h, memory=memory, mask=memory_mask)[0]  # noqa: E731
    if block.placement == "pre":  # x + f(LN(x))
        x = x + attn(block.norm1(x))
        if block.cross is not None:
            x = x + cross(block.norm_cross(x))
        return x + block.ffn(block.norm2(x))
    # post: LN(x + f(x)) -- the residual is inside the norm
    x = block.norm1(x + attn(x))
    if block.cross is not None:
        x = block.norm_cross(x + cross(x))
    return block.norm2(x + block.ffn(x))


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("cross", [False, True])
def test_block_equals_formula(placement, norm, cross):
    block = randomize(Block(16, 4, placement=placement, norm=norm, causal=True, cross_attention=cross)).eval()
    x = torch.randn(2, 5, 16)
    keep = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    mask = keep[:, None, None, :]
    memory, mkeep = torch.randn(2, 7, 16), torch.tensor([[1] * 7, [1] * 4 + [0] * 3], dtype=torch.bool)
    mmask = mkeep[:, None, None, :]
    kw = dict(memory=memory, memory_mask=mmask) if cross else {}
    y, _ = block(x, mask=mask, keep=keep, **kw)
    torch.testing.assert_close(y, reference(block, x, mask=mask, **kw), atol=1e-5, rtol=0)


def test_pre_and_post_differ():
    # same weights, different formulas: the two placements must not compute the same function
    pre = randomize(Block(16, 4, placement="pre")).eval()
    post = Block(16, 4, placement="post").eval()
    post.load_state_dict(pre.state_dict())
    x = torch.randn(2, 5, 16)
    assert not torch.allclose(pre(x)[0], post(x)[0], atol=1e-3)


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_block_passes_position_hooks_to_attention(placement):
    # RoPE rotation and the ALiBi bias reach the attention: the block equals the formula with them
    block = randomize(Block(16, 4, placement=placement, causal=True)).eval()
    x = torch.randn(2, 5, 16)
    rope = RoPE(4)
    y, _ = block(x, position=rope)
    torch.testing.assert_close(y, reference(block, x, position=rope), atol=1e-5, rtol=0)
    assert not torch.allclose(y, block(x)[0], atol=1e-4)
    bias = ALiBi(4).bias(5, 5)
    y, _ = block(x, bias=bias)
    torch.testing.assert_close(y, reference(block, x, bias=bias), atol=1e-5, rtol=0)


def test_block_returns_weights_when_asked():
    block = Block(16, 4, cross_attention=True, attention="naive").eval()
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 3, 16)
    _, w = block(x, memory=memory, return_weights=True)
    assert w["self"].shape == (2, 4, 5, 5) and w["cross"].shape == (2, 4, 5, 3)
    _, w = block(x, memory=memory)
    assert w == {}


def test_block_dropout_only_in_training():
    block = Block(16, 4, dropout=0.5)
    x = torch.randn(2, 5, 16)
    block.eval()
    torch.testing.assert_close(block(x)[0], block(x)[0])
    block.train()
    assert not torch.allclose(block(x)[0], block(x)[0])


def test_unknown_placement():
    with pytest.raises(ValueError, match="unknown norm placement"):
        Block(16, 4, placement="sandwich")
