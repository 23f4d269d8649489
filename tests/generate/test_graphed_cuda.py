"""On a CUDA GPU (skipped elsewhere): generate(..., compile=True) — Inductor with mode="reduce-overhead", the
decoding step replayed as a CUDA graph — gives the eager path's tokens, batch 1 and a left-padded batch, fp32
and bf16. bf16: Inductor fuses ops with fp32 intermediates where eager rounds each op, so a near tie may flip
and the sequences part there: the tokens must be equal up to the first difference, and at that position the
two tokens' eager logits must be within bf16's rounding of each other (a share of equal positions, counted
after a flip, measured nothing: 53-78% on an H200)."""

from __future__ import annotations

import pytest
import torch

import qkv

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# two tokens whose eager bf16 logits differ by less than this share of the logits' largest magnitude are a
# near tie: bf16 keeps 8 bits (2^-8 relative per rounding), and two layers of rounded sums add a few of them
NEAR_TIE = 2.0 ** -5


def _check_until_near_tie(m, ids, mask, got, want) -> None:
    T = ids.shape[1]
    for row in range(ids.shape[0]):
        diff = (got[row, T:] != want[row, T:]).nonzero()
        if diff.numel() == 0:
            continue
        j = T + int(diff[0])
        with torch.no_grad():
            logits = m(want[row: row + 1, :j], attention_mask=mask_for(mask[row: row + 1], j)).logits[0, -1]
        gap = (logits[want[row, j]] - logits[got[row, j]]).abs().float()
        assert gap <= NEAR_TIE * logits.abs().max().float(), (row, j, float(gap))


def mask_for(mask: torch.Tensor, length: int) -> torch.Tensor:
    """The prompt's mask extended with ones over the generated tokens, to `length` columns."""
    ones = torch.ones(mask.shape[0], max(0, length - mask.shape[1]), dtype=mask.dtype, device=mask.device)
    return torch.cat([mask, ones], 1)[:, :length]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("position", ["learned", "rope"])
def test_graph_captured_greedy_tokens_equal_eager(dtype, position):
    torch.manual_seed(0)
    m = qkv.build("gpt-nano", vocab_size=97, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                  context_length=64, position=position, init_std=0.3).to("cuda", dtype).eval()
    for batch in (1, 3):
        ids = torch.randint(0, 97, (batch, 6), device="cuda")
        mask = torch.ones(batch, 6, dtype=torch.long, device="cuda")
        mask[1:, :2] = 0
        want = m.generate(ids, 24, attention_mask=mask)
        got = m.generate(ids, 24, attention_mask=mask, compile=True)
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:
            _check_until_near_tie(m, ids, mask, got, want)
