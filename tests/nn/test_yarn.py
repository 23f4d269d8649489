"""YaRN RoPE scaling (nn/position.py) against transformers' _compute_yarn_parameters (frequencies and the
cos/sin factor, with and without DeepSeek's mscale pair, truncated or not), and a Qwen2 folder with YaRN
against transformers' logits past the original context."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.nn.position import RoPE, rope_attention_factor, rope_inv_freq

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("extra", [{}, {"mscale": 0.707, "mscale_all_dim": 1.0}, {"truncate": False},
                                   {"beta_fast": 16, "beta_slow": 2, "attention_factor": 1.3}])
def test_frequencies_and_factor_equal_transformers(extra):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
            "original_max_position_embeddings": 128, **extra}
    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=1024,
                                   rope_parameters=rope)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    got = rope_inv_freq(64, 10000.0, rope)
    torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=0)
    assert rope_attention_factor(rope) == pytest.approx(factor, rel=1e-12)
    assert not torch.allclose(got, rope_inv_freq(64, 10000.0))  # the rule changed something
    table = RoPE(64, 16, 10000.0, rope)
    assert table.cos[0].max().item() == pytest.approx(factor, rel=1e-6)  # cos(0) = 1, times the factor


def test_qwen2_yarn_folder_equals_transformers(tmp_path):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
    cfg = transformers.Qwen2Config(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rope_parameters=rope, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    ids = torch.randint(0, 200, (1, 60))  # well past the original 16 positions
    with torch.no_grad():
        want, got = hf(ids).logits, ours(ids).logits
    assert ((got - want).abs().max() / want.abs().max()) < 1e-4
