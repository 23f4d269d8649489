"""benchmarks/train_vs_nanogpt.py: --quick runs end to end with a stand-in for nanoGPT's model.py (nanoGPT is
not shipped; the test writes a small GPT-2 with nanoGPT's interface into tmp_path), the three models compute
the same function from the same weights (equal fp32 first-step losses: this checks the Conv1D transposition),
and a missing --nanogpt path is one clear error."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

# nanoGPT's interface (GPTConfig fields, module names, forward(idx, targets) -> (logits, loss)), written
# independently: plain GPT-2 with nn.Linear (out, in) weights and a tied lm_head.
STAND_IN = '''
import math
from dataclasses import dataclass
import torch
import torch.nn as nn
import torch.nn.functional as F

@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True

class Attn(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)
        self.h = c.n_head
    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.h)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(B, T, C))

class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd)
    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(c.n_embd), Attn(c)
        self.ln_2, self.mlp = nn.LayerNorm(c.n_embd), MLP(c)
    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(c.vocab_size, c.n_embd),
            wpe=nn.Embedding(c.block_size, c.n_embd), h=nn.ModuleList([Block(c) for _ in range(c.n_layer)]),
            ln_f=nn.LayerNorm(c.n_embd)))
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                            ignore_index=-1)
        return logits, loss
    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        extra = dict(fused=True) if device_type == "cuda" else dict()
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra)
'''


def test_quick_benchmark_with_a_stand_in_nanogpt(tmp_path, run_benchmark):
    model_py = tmp_path / "nano" / "model.py"
    model_py.parent.mkdir()
    model_py.write_text(STAND_IN, encoding="utf-8")
    run_benchmark("train_vs_nanogpt", "--nanogpt", str(model_py), "--quick", "--threads", "1", "--out",
                  str(tmp_path / "out"))
    result = json.loads((tmp_path / "out" / "train_vs_nanogpt_quick.json").read_text())
    assert {(row["model"], row["precision"]) for row in result["rows"]
                if not row["model"].startswith("recipe:")} == {
        (m, p) for m in ("qkv GPT", "nanoGPT GPT", "HF GPT2LMHeadModel (sdpa)", "qkv GPT, exact GELU")
        for p in ("fp32", "bf16")}
    loss = result["first_step_loss"]  # same weights, same batch: the same function (fp32)
    assert abs(loss["qkv GPT fp32"] - loss["nanoGPT GPT fp32"]) < 1e-4
    assert abs(loss["HF GPT2LMHeadModel (sdpa) fp32"] - loss["nanoGPT GPT fp32"]) < 1e-4
    # erf vs the stand-in's tanh
    assert abs(loss["qkv GPT, exact GELU fp32"] - loss["nanoGPT GPT fp32"]) < 1e-2
    assert abs(loss["qkv GPT bf16"] - loss["nanoGPT GPT bf16"]) < 0.05  # bf16: rounding differs by kernel
    assert all(row["tokens_per_s"] > 0 for row in result["rows"])
    assert len(result["ratios"]["fp32"]["qkv/nanoGPT"]["per_round"]) == result["rounds"] == 2
    md = (tmp_path / "out" / "train_vs_nanogpt_quick.md").read_text()
    assert "qkv / nanoGPT" in md
    # each project's recipe: nanoGPT's configure_optimizers on CPU = torch's loop, qkv's Trainer = fused AdamW
    recipes = {row["model"] for row in result["rows"] if row["model"].startswith("recipe:")}
    assert recipes == {"recipe: nanoGPT loop, its configure_optimizers AdamW",
                       "recipe: qkv loop, Trainer's AdamW",
                       "recipe: qkv loop, torch's default AdamW", "recipe: qkv Trainer.fit"}
    assert result["recipes"]["optimizers"] == {"nanoGPT recipe": "loop",
                                               "qkv recipe (Trainer's build_optimizer)": "fused",
                                               "qkv torch default": "loop"}
    for p in ("fp32", "bf16"):
        assert len(result["recipes"]["ratios"][p]["trainer_overhead"]["per_round"]) == 2
    assert abs(loss["recipe: qkv loop, Trainer's AdamW fp32"]
               - loss["recipe: nanoGPT loop, its configure_optimizers AdamW fp32"]) < 1e-4
    assert "Trainer.fit overhead over the bare qkv loop" in md and "each recipe" in md
    assert (set(result["recipes"]["adamw_update_ms"]) == {"loop", "foreach", "fused"}
            and "AdamW update alone" in md)


def test_optimizer_choice_applies_to_every_model(tmp_path, run_benchmark):
    """--optimizer fused: every model trains with the same fused AdamW (the first step's loss comes before the
    update, so it is the same as with the default loop) and the JSON says which implementation ran."""
    model_py = tmp_path / "model.py"
    model_py.write_text(STAND_IN, encoding="utf-8")
    run_benchmark("train_vs_nanogpt", "--nanogpt", str(model_py), "--quick", "--threads", "1", "--precisions",
                  "fp32", "--optimizer", "fused", "--no-recipes", "--out", str(tmp_path / "out"))
    result = json.loads((tmp_path / "out" / "train_vs_nanogpt_quick.json").read_text())
    assert result["config"]["optimizer"].endswith(", fused")
    assert result["recipes"] is None  # --no-recipes
    assert (abs(result["first_step_loss"]["qkv GPT fp32"] - result["first_step_loss"]["nanoGPT GPT fp32"])
            < 1e-4)


def test_missing_nanogpt_path_is_one_clear_error(tmp_path, run_benchmark):
    r = run_benchmark("train_vs_nanogpt", "--nanogpt", str(tmp_path / "absent" / "model.py"), "--quick",
                      "--out", str(tmp_path), expect_status=2)
    assert "train_vs_nanogpt: error: --nanogpt" in r.stderr and "no such file" in r.stderr
    assert "Traceback" not in r.stderr
    assert not list(tmp_path.glob("*.json"))
