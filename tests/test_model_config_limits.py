"""MoE and MLA configs that claim too much: 10^9 experts, top_k above the experts, a latent rank of 0 or wider
than the model. Each is one ConfigError before a parameter (or an expert module) is built, through the
config and through `qkv train`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qkv.config import ConfigError
from qkv.models.gpt import GPT, GPTConfig
from qkv.nn.mla import MLAConfig
from qkv.nn.moe import MoEConfig

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(vocab_size=50, n_layers=2, d_model=32, n_heads=4, context_length=32)
MLA = dict(position="rope", head_dim=8, ffn="swiglu", norm="rmsnorm", bias=False)


def config(**kw) -> GPTConfig:
    cfg = GPTConfig(**SMALL, **kw)
    cfg.validate()
    return cfg


def test_a_billion_experts_are_refused_before_one_is_built():
    cfg = config(moe=MoEConfig(n_experts=10**9, n_experts_per_tok=2))  # the config alone is valid
    t = time.perf_counter()
    with pytest.raises(ConfigError, match=r"moe.n_experts is 1,000,000,000: 2 layers of them need at least "
                                          r"[\d,.]+ GiB, more than this machine's"):
        GPT(cfg)
    assert time.perf_counter() - t < 5  # building them: ~1 ms each, 10^9 of them


def test_top_k_above_the_experts_is_refused():
    with pytest.raises(ConfigError, match=r"moe.n_experts_per_tok must be in 1..n_experts \(4\), got 8"):
        config(moe=MoEConfig(n_experts=4, n_experts_per_tok=8))


@pytest.mark.parametrize("field, rank", [("kv_lora_rank", 33), ("kv_lora_rank", 100_000),
                                         ("q_lora_rank", 64)])
def test_a_latent_wider_than_the_model_is_refused(field, rank):
    mla = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, field: rank}
    with pytest.raises(ConfigError, match=f"mla.{field} is {rank}, larger than d_model \\(32\\)"):
        config(**MLA, mla=MLAConfig(**mla))
    config(**MLA, mla=MLAConfig(**{**mla, field: 32}))  # as wide as the model: allowed


def test_a_latent_rank_below_zero_is_refused_and_zero_means_no_mla():
    with pytest.raises(ConfigError, match="mla.kv_lora_rank must be >= 0"):
        config(**MLA, mla=MLAConfig(kv_lora_rank=-1))
    assert not config(**MLA, mla=MLAConfig(kv_lora_rank=0)).mla.enabled


def test_qkv_train_says_it_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = ["train", "charlm", "--out", str(tmp_path / "run"), "--max-steps", "1",
           "model.moe.n_experts=1000000000"]
    r = subprocess.run([sys.executable, "-m", "qkv.cli.main", *cmd], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 2 and r.stderr.startswith("qkv: error: moe.n_experts is 1,000,000,000"), r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "run" / "checkpoints").exists()
