"""The routing-balance figure (MaxVio = max load / mean load - 1, qkv.nn.moe): its formula on hand-made
counts, what a training forward tallies (and an eval forward does not), and the trainer's `moe_maxvio` log
entry for a MoE model (none for a dense one)."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.models.gpt import GPT, GPTConfig
from qkv.nn.moe import MoEConfig, MoEFeedForward, max_violation, moe_max_violation


@pytest.mark.parametrize("counts, expected", [
    ([5, 5, 5, 5, 5, 5, 5, 5], 0.0),  # perfectly even: the ideal value
    ([40, 0, 0, 0, 0, 0, 0, 0], 7.0),  # every assignment to one expert: E - 1, the worst
    ([20, 20, 0, 0, 0, 0, 0, 0], 3.0),  # a top-2 router's worst: every token to the same two, E / k - 1
    ([4, 2, 2, 0], 1.0),  # max 4, mean 2
    ([3, 2, 1, 2], 0.5),  # max 3, mean 2
])
def test_max_violation_equals_its_formula(counts, expected):
    got = max_violation(torch.tensor(counts))
    assert got.dtype == torch.float64
    assert float(got) == pytest.approx(expected, abs=1e-12)
    c = [float(v) for v in counts]
    assert float(got) == pytest.approx(max(c) / (sum(c) / len(c)) - 1, abs=1e-12)


def tiny_gpt(seed: int = 0, **moe) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=40, n_layers=3, d_model=32, n_heads=4, context_length=64, ffn="swiglu",
                    norm="rmsnorm", position="rope", bias=False, d_ff=48,
                    moe=MoEConfig(**{"n_experts": 4, "n_experts_per_tok": 2, "first_k_dense": 1, **moe}))
    return GPT(cfg)


def test_training_forwards_are_tallied_per_layer_and_averaged():
    """Two training forwards (two micro-batches of one update) pooled per layer, MaxVio per layer from the
    router's own choices recomputed outside the layer, then the mean over the MoE layers."""
    model = tiny_gpt().train()
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    assert len(layers) == 2
    counts = {id(layer): torch.zeros(4, dtype=torch.float64) for layer in layers}

    def recount(layer, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        chosen = layer.router(x).experts.reshape(-1)
        counts[id(layer)] += torch.bincount(chosen, minlength=4).double()

    hooks = [layer.register_forward_pre_hook(recount) for layer in layers]
    for seed in (1, 2):
        ids = torch.randint(0, 40, (3, 17), generator=torch.Generator().manual_seed(seed))
        model(ids, labels=ids)
    for h in hooks:
        h.remove()
    per_layer = [float(c.max() / c.mean() - 1) for c in counts.values()]
    assert max(per_layer) > 0  # a random router is not perfectly even: the test can tell layers apart
    assert moe_max_violation(model) == pytest.approx(sum(per_layer) / 2, abs=1e-12)
    assert moe_max_violation(model) is None  # taken by the first reading


def test_eval_forwards_and_dense_models_tally_nothing():
    model = tiny_gpt().eval()
    with torch.no_grad():
        model(torch.randint(0, 40, (2, 9)))
    assert moe_max_violation(model) is None
    dense = GPT(GPTConfig(vocab_size=40, n_layers=2, d_model=32, n_heads=4)).train()
    ids = torch.randint(0, 40, (2, 9))
    dense(ids, labels=ids)
    assert moe_max_violation(dense) is None


def _train(model: GPT, out) -> list[dict]:
    from qkv.train import TrainConfig, Trainer

    class Repeat:  # each token is the previous + 1
        def batch(self, index, batch_size, split="train"):
            g = torch.Generator().manual_seed(index * 2 + (split != "train"))
            ids = (torch.randint(0, 40, (batch_size, 1), generator=g) + torch.arange(16)) % 40
            return {"input_ids": ids, "labels": ids}

    cfg = TrainConfig(max_steps=8, batch_size=4, lr=3e-3, warmup=2, out_dir=str(out), progress=False,
                      tensorboard=False, plot=True, log_every=2, grad_accum=2, max_eval_batches=1,
                      eval_every=4)
    Trainer(model, cfg, Repeat()).fit()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_moe_training_run_logs_moe_maxvio_beside_aux_loss_and_a_dense_one_does_not(tmp_path):
    records = _train(tiny_gpt(), tmp_path / "moe")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 4, 6, 8]
    assert all("aux_loss" in r and 0.0 <= r["moe_maxvio"] <= 1.0 for r in steps)  # E / k - 1 = 1 at worst
    assert not any("moe_maxvio" in r for r in records if "loss" not in r)  # the eval rows have none
    assert (tmp_path / "moe" / "curves.png").is_file()
    torch.manual_seed(0)
    dense = GPT(GPTConfig(vocab_size=40, n_layers=2, d_model=32, n_heads=4))
    records = _train(dense, tmp_path / "dense")
    assert records and not any("moe_maxvio" in r or "aux_loss" in r for r in records)
