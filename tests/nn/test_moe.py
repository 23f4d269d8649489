"""The mixture-of-experts layer (nn/moe.py) against direct formulas: routing (softmax / sigmoid, top-k,
renormalisation, scaling, group-limited choice, the selection bias) in float64, dispatch against a per-token
loop, the load-balancing loss against its formula, gradients (gradcheck), the decoding step, the bias update,
per-layer MoE blocks in GPT, and a tiny training run whose loss falls with the aux loss logged."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from qkv.config import ConfigError
from qkv.models.gpt import GPT, GPTConfig
from qkv.nn.ffn import FeedForward
from qkv.nn.moe import MoEConfig, MoEFeedForward, Router, load_balancing_loss, moe_aux_loss

D = 12


def router(seed: int = 0, **kw) -> Router:
    torch.manual_seed(seed)
    r = Router(D, MoEConfig(**{"n_experts": 8, "n_experts_per_tok": 2, **kw})).double()
    torch.nn.init.normal_(r.weight)
    return r


def reference_routing(x: torch.Tensor, w: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None = None):
    """Token by token, expert by expert: the formulas of the module docstring written out with Python
    loops."""
    out_w, out_e = [], []
    for row in x:
        logits = [float(row @ w[e]) for e in range(cfg.n_experts)]
        if cfg.score == "softmax":
            m = max(logits)
            z = sum(pow(2.718281828459045, v - m) for v in logits)
            scores = [pow(2.718281828459045, v - m) / z for v in logits]
        else:
            scores = [1 / (1 + pow(2.718281828459045, -v)) for v in logits]
        choice = [s + (float(bias[e]) if bias is not None else 0.0) for e, s in enumerate(scores)]
        size = cfg.n_experts // cfg.n_group
        groups = [sorted(choice[g * size:(g + 1) * size], reverse=True) for g in range(cfg.n_group)]
        group_score = [sum(g[:min(2, size)]) for g in groups]
        best = sorted(range(cfg.n_group), key=lambda g: -group_score[g])[:cfg.topk_group]
        allowed = [e for e in range(cfg.n_experts) if e // size in best]
        chosen = sorted(allowed, key=lambda e: -choice[e])[:cfg.n_experts_per_tok]
        weights = [scores[e] for e in chosen]
        if cfg.norm_topk:
            total = sum(weights)
            weights = [v / total for v in weights]
        out_w.append([v * cfg.routed_scaling for v in weights])
        out_e.append(chosen)
    return torch.tensor(out_w, dtype=torch.float64), torch.tensor(out_e)


@pytest.mark.parametrize("kw", [
    {},  # Mixtral: softmax, top-2, renormalised
    {"norm_topk": False, "n_experts_per_tok": 3},  # Qwen-MoE's default
    {"score": "sigmoid", "routed_scaling": 2.5},
    # DeepSeek-V3
    {"score": "sigmoid", "n_group": 4, "topk_group": 2, "n_experts_per_tok": 3, "routed_scaling": 2.5},
    {"score": "softmax", "n_group": 2, "topk_group": 1, "norm_topk": False},
])
def test_routing_equals_the_formula_in_float64(kw):
    r = router(**kw)
    x = torch.randn(40, D, dtype=torch.float64)
    routing = r(x.double())
    want_w, want_e = reference_routing(x, r.weight.detach(), r.cfg)
    # the order of equal-score experts is topk's; compare as sets with their weights
    got = sorted(zip(routing.experts.flatten().tolist(), routing.weights.flatten().tolist()))
    want = sorted(zip(want_e.flatten().tolist(), want_w.flatten().tolist()))
    assert [e for e, _ in got] == [e for e, _ in want]
    torch.testing.assert_close(torch.tensor([w for _, w in got], dtype=torch.float64),
                               torch.tensor([w for _, w in want], dtype=torch.float64), rtol=1e-12,
                               atol=1e-13)
    torch.testing.assert_close(routing.probs.sum(-1), torch.ones(40, dtype=torch.float64))


def test_group_limited_routing_never_leaves_the_chosen_groups():
    r = router(score="sigmoid", n_group=4, topk_group=1, n_experts_per_tok=2)
    routing = r(torch.randn(200, D, dtype=torch.float64))
    groups = routing.experts // 2
    assert torch.equal(groups[:, 0], groups[:, 1])  # one group allowed: both experts inside it


def test_the_selection_bias_chooses_but_does_not_weigh():
    r = router(score="sigmoid", bias_balance=True, norm_topk=False)
    x = torch.randn(30, D, dtype=torch.float64)
    r.score_bias[3] = 10.0  # expert 3 always chosen
    routing = r(x)
    assert (routing.experts == 3).any(-1).all()
    want_w, want_e = reference_routing(x, r.weight.detach(), r.cfg, bias=r.score_bias)
    assert torch.equal(routing.experts.sort(-1).values, want_e.sort(-1).values)
    scores = torch.sigmoid(x @ r.weight.detach().T)
    # the weight is the raw score
    torch.testing.assert_close(routing.weights, scores.gather(1, routing.experts))


def test_bias_update_moves_towards_the_underloaded_experts():
    layer = MoEFeedForward(D, MoEConfig(n_experts=4, n_experts_per_tok=1, score="sigmoid", bias_balance=True,
                                        bias_rate=0.1), d_ff=8).train()
    layer.router.load.copy_(torch.tensor([10, 0, 5, 5]))
    layer.router.update_bias()
    torch.testing.assert_close(layer.router.score_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    assert layer.router.load.sum() == 0
    layer(torch.randn(7, D))
    assert layer.router.load.sum() == 7  # counted by the training forward
    assert "router.score_bias" in layer.state_dict() and "router.load" not in layer.state_dict()


def moe_layer(seed: int = 0, dtype=torch.float64, **kw) -> MoEFeedForward:
    torch.manual_seed(seed)
    cfg = MoEConfig(**{"n_experts": 5, "n_experts_per_tok": 2, **kw})
    layer = MoEFeedForward(D, cfg, d_ff=10, activation="swiglu").to(dtype)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return layer


@pytest.mark.parametrize("kw", [{}, {"norm_topk": False, "n_shared_experts": 1, "shared_expert_gate": True},
                                {"score": "sigmoid", "n_group": 5, "topk_group": 2, "shared_ffn_dim": 7}])
def test_dispatch_equals_a_per_token_loop(kw):
    layer = moe_layer(**kw).eval()
    x = torch.randn(3, 11, D, dtype=torch.float64)
    with torch.no_grad():
        got = layer(x)
        routing = layer.router(x.reshape(-1, D))
        want = torch.zeros(33, D, dtype=torch.float64)
        for t, row in enumerate(x.reshape(-1, D)):
            for w, e in zip(routing.weights[t].tolist(), routing.experts[t].tolist()):
                want[t] += w * layer.experts[e](row[None])[0]
            if layer.shared is not None:
                g = torch.sigmoid(layer.shared_gate(row)) if layer.shared_gate is not None else 1.0
                want[t] += g * layer.shared(row[None])[0]
    torch.testing.assert_close(got.reshape(-1, D), want, rtol=1e-12, atol=1e-12)
    assert got.shape == x.shape


def test_experts_are_the_ffn_module():
    layer = moe_layer()
    assert all(type(e) is FeedForward and e.activation == "swiglu" for e in layer.experts)


def test_an_expert_nobody_chose_and_an_empty_batch():
    layer = moe_layer(n_experts=6, n_experts_per_tok=1).eval()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2, 0] = 100.0
        x = torch.randn(4, D, dtype=torch.float64).abs()  # every token to expert 2
        torch.testing.assert_close(layer(x), layer.experts[2](x))
        assert layer(torch.zeros(0, D, dtype=torch.float64)).shape == (0, D)


def test_step_is_forward():
    layer = moe_layer().eval()
    x = torch.randn(6, D, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(layer.step(x), layer(x))


def test_load_balancing_loss_equals_the_formula():
    layers = [moe_layer(seed=s, dtype=torch.float32, n_experts_per_tok=2).train() for s in range(2)]
    xs = [torch.randn(20, D), torch.randn(20, D)]
    for layer, x in zip(layers, xs):
        layer(x)
    got = load_balancing_loss([layer.stats for layer in layers])
    E, counts, probs = 5, torch.zeros(5), torch.zeros(5)
    for layer, x in zip(layers, xs):
        p = F.softmax(x @ layer.router.weight.detach().T, -1)
        counts += F.one_hot(p.topk(2, -1).indices, E).sum((0, 1))
        probs += p.sum(0)
    # Switch eq. 4: N * sum_e f_e P_e, pooled over both layers
    want = E * ((counts / 40) * (probs / 40)).sum()
    torch.testing.assert_close(got, want)
    uniform = load_balancing_loss([type(layers[0].stats)(torch.full((5,), 8.0), torch.full((5,), 4.0), 20)])
    torch.testing.assert_close(uniform, torch.tensor(2.0))  # perfectly balanced: k


def test_gradcheck_through_routing_weights_and_experts():
    layer = moe_layer(n_shared_experts=1, shared_expert_gate=True).train()
    x = torch.randn(6, D, dtype=torch.float64, requires_grad=True)

    def f(x):  # the chosen experts do not change under gradcheck's tiny perturbations
        y = layer(x)
        return y, load_balancing_loss([layer.stats])

    assert torch.autograd.gradcheck(lambda x: f(x)[0], (x,))
    assert torch.autograd.gradcheck(lambda x: f(x)[1], (x,))
    layer.router.weight.grad = None
    f(x)[1].backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


# -- in GPT ------------------------------------------------------------------------------------------------
def tiny_moe_gpt(seed: int = 0, **moe) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=40, n_layers=3, d_model=32, n_heads=4, context_length=64, ffn="swiglu",
                    norm="rmsnorm", position="rope", bias=False, d_ff=48,
                    moe=MoEConfig(**{"n_experts": 4, "n_experts_per_tok": 2, "first_k_dense": 1, **moe}))
    return GPT(cfg)


def test_blocks_choose_dense_or_moe_per_layer():
    assert [type(b.ffn).__name__ for b in tiny_moe_gpt().decoder.blocks] == \
        ["FeedForward", "MoEFeedForward", "MoEFeedForward"]
    assert [type(b.ffn).__name__ for b in tiny_moe_gpt(layers=[0, 2]).decoder.blocks] == \
        ["MoEFeedForward", "FeedForward", "MoEFeedForward"]
    dense = GPT(GPTConfig(vocab_size=40, n_layers=2, d_model=32, n_heads=4))
    assert not any(isinstance(m, MoEFeedForward) for m in dense.modules())


@pytest.mark.parametrize("moe, message", [
    ({"n_experts": 4, "n_experts_per_tok": 5}, "n_experts_per_tok"),
    ({"n_experts": 6, "n_group": 4}, "must divide"),
    ({"n_experts": 4, "layers": [7]}, "not blocks"),
    ({"n_experts": 4, "score": "tanh"}, "score"),
    ({"n_experts": 4, "shared_expert_gate": True}, "needs a shared expert"),
])
def test_bad_moe_configs_are_one_clear_error(moe, message):
    with pytest.raises(ConfigError, match=message):
        GPT(GPTConfig(vocab_size=40, n_layers=2, d_model=32, n_heads=4, moe=MoEConfig(**moe)))


def test_cached_decoding_equals_full_forward():
    """The KV-cache step (Block.step -> MoEFeedForward.step) one token and a chunk at a time."""
    model = tiny_moe_gpt(n_shared_experts=1).eval()
    ids = torch.randint(0, 40, (2, 14))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.make_cache(2, 32)
        first = model(ids[:, :7], cache=cache).logits
        torch.testing.assert_close(first, full[:, :7], atol=1e-5, rtol=0)
        for t in range(7, 11):
            torch.testing.assert_close(model.step(ids[:, t:t + 1], cache), full[:, t], atol=1e-5, rtol=0)
        torch.testing.assert_close(model.step(ids[:, 11:], cache), full[:, -1], atol=1e-5, rtol=0)


def test_tiny_training_run_lowers_the_loss_and_logs_the_aux_loss(tmp_path):
    from qkv.train import TrainConfig, Trainer

    class Repeat:  # a learnable pattern: each token is the previous + 1
        def batch(self, index, batch_size, split="train"):
            g = torch.Generator().manual_seed(index * 2 + (split != "train"))
            ids = (torch.randint(0, 40, (batch_size, 1), generator=g) + torch.arange(16)) % 40
            return {"input_ids": ids, "labels": ids}

    model = tiny_moe_gpt(score="sigmoid", bias_balance=True, bias_rate=0.01)
    cfg = TrainConfig(max_steps=30, batch_size=8, lr=3e-3, warmup=3, out_dir=str(tmp_path), progress=False,
                      tensorboard=False, plot=False, log_every=1)
    Trainer(model, cfg, Repeat()).fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "aux_loss" in r]
    assert len(steps) == 30
    assert all(1.0 <= r["aux_loss"] <= 4.0 for r in steps)  # k = 2 at balance, E = 4 at worst
    assert sum(r["loss"] for r in steps[-5:]) < 0.75 * sum(r["loss"] for r in steps[:5])
    biases = [b.ffn.router.score_bias for b in model.decoder.blocks[1:]]
    assert all(b.abs().sum() > 0 for b in biases)  # the balancing bias moved
    assert moe_aux_loss(model) is None  # taken by each forward


def test_save_and_load_keep_the_experts_and_the_selection_bias(tmp_path):
    import qkv

    model = tiny_moe_gpt(score="sigmoid", bias_balance=True).eval()
    model.decoder.blocks[1].ffn.router.score_bias.copy_(torch.tensor([0.3, -0.1, 0.0, 0.2]))
    model.save_pretrained(tmp_path)
    back = qkv.from_pretrained(tmp_path)
    assert back.config == model.config
    assert torch.equal(back.decoder.blocks[1].ffn.router.score_bias,
                       model.decoder.blocks[1].ffn.router.score_bias)
    ids = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_gradient_checkpointing_gives_the_same_gradients_and_aux_loss():
    """The recomputation in backward routes the same tokens the same way (no state changes between the
    two)."""
    ids = torch.randint(0, 40, (2, 10))
    grads, aux = [], []
    for checkpointing in (False, True):
        model = tiny_moe_gpt(seed=3, n_shared_experts=1, score="sigmoid", bias_balance=True).train()
        model.set_gradient_checkpointing(checkpointing)
        out = model(ids, labels=ids)
        out.loss.backward()
        aux.append(out.aux_loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
        # counted (the recomputation counts again)
        assert int(model.decoder.blocks[1].ffn.router.load.sum()) >= 20
    torch.testing.assert_close(aux[0], aux[1])
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], msg=n)
