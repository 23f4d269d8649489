import math

import pytest

from qkv.config import ConfigError, from_dict
from qkv.train import TrainConfig, lr_at, noam


def test_unknown_key_names_closest():
    with pytest.raises(ConfigError, match="did you mean 'grad_accum'"):
        from_dict(TrainConfig, {"grad_acum": 4})


@pytest.mark.parametrize("bad", [{"lr": -1.0}, {"betas": [0.9]}, {"warmup": 2.5}, {"clip_grad": 0.0},
                                 {"schedule": "noam", "warmup": 0}, {"precision": "fp8"}, {"max_steps": 0},
                                 {"device": "tpu"}])
def test_bad_values_are_config_errors(bad):
    with pytest.raises(ConfigError):
        from_dict(TrainConfig, bad)


def test_yaml_style_values_coerce():
    cfg = from_dict(TrainConfig, {"warmup": 100, "clip_grad": None, "betas": [0.9, 0.95]})
    assert cfg.warmup_steps() == 100 and cfg.clip_grad is None and cfg.betas == [0.9, 0.95]
    assert from_dict(TrainConfig, {"warmup": 0.1, "max_steps": 500}).warmup_steps() == 50


@pytest.mark.parametrize("d_model,warmup,factor", [(512, 4000, 1.0), (32, 400, 2.0), (384, 10, 0.5)])
def test_noam_matches_paper_formula(d_model, warmup, factor):
    # Vaswani et al. 2017, eq. (3): lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    for step in [1, 2, warmup // 2, warmup - 1, warmup, warmup + 1, 3 * warmup, 100_000]:
        step = max(step, 1)
        want = factor * (d_model ** -0.5) * min(step ** -0.5, step * warmup ** -1.5)
        got = lr_at(step, schedule="noam", lr=factor, warmup=warmup, max_steps=10, d_model=d_model)
        assert got == pytest.approx(want, rel=1e-12)
        assert noam(step, d_model, warmup, factor) == pytest.approx(want, rel=1e-12)
    # the peak is at step == warmup and equals factor / sqrt(d_model * warmup)
    peak = max(lr_at(s, schedule="noam", lr=factor, warmup=warmup, max_steps=1, d_model=d_model)
               for s in range(1, 3 * warmup))
    assert peak == pytest.approx(factor / math.sqrt(d_model * warmup), rel=1e-12)


def test_noam_needs_d_model():
    with pytest.raises(ConfigError, match="d_model"):
        lr_at(1, schedule="noam", lr=1.0, warmup=10, max_steps=10)


def test_warmup_then_cosine_to_floor():
    kw = dict(schedule="cosine", lr=1e-3, warmup=10, max_steps=110, min_lr=1e-5)
    assert lr_at(1, **kw) == pytest.approx(1e-4)  # linear warmup: lr * step / warmup
    assert lr_at(10, **kw) == pytest.approx(1e-3)
    assert lr_at(11, **kw) == pytest.approx(1e-3)  # the first update after the warmup still at the peak
    assert lr_at(61, **kw) == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5))  # halfway down the cosine
    assert lr_at(110, **kw) > 1e-5  # the last update is not wasted at the floor
    assert lr_at(111, **kw) == pytest.approx(1e-5)
    assert lr_at(500, **kw) == pytest.approx(1e-5)  # clamped past the end


@pytest.mark.parametrize("max_steps, warmup", [(1, 0), (2, 0), (8, 0), (8, 3), (100, 10)])
def test_cosine_and_linear_decay_equal_transformers_schedules(max_steps, warmup):
    """After the warmup, update k (1-based) gets transformers' LambdaLR factor at its step k - 1 (counted from
    0):
    no update runs at lr 0, even in a one-update run (which used to change nothing)."""
    transformers = pytest.importorskip("transformers")
    import torch

    for name, make in (("cosine", transformers.get_cosine_schedule_with_warmup),
                       ("linear", transformers.get_linear_schedule_with_warmup)):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = make(opt, warmup, max_steps)
        for k in range(1, max_steps + 1):
            want = opt.param_groups[0]["lr"]
            if k > warmup:  # (the warmups differ: transformers' first update runs at 0, ours at lr / warmup)
                assert (lr_at(k, schedule=name, lr=1.0, warmup=warmup, max_steps=max_steps)
                        == pytest.approx(want))
                assert want > 0
            opt.step()
            sched.step()


def test_inverse_sqrt_linear_constant():
    assert lr_at(5, schedule="inverse_sqrt", lr=1.0, warmup=10, max_steps=100) == pytest.approx(0.5)
    assert (lr_at(40, schedule="inverse_sqrt", lr=1.0, warmup=10, max_steps=100)
            == pytest.approx(math.sqrt(10 / 40)))
    assert lr_at(56, schedule="linear", lr=1.0, warmup=10, max_steps=100, min_lr=0.1) == pytest.approx(0.55)
    assert lr_at(1, schedule="constant", lr=0.3, warmup=0, max_steps=100) == 0.3  # the no-warmup ablation
    assert lr_at(1, schedule="constant", lr=0.3, warmup=3, max_steps=100) == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="unknown schedule"):
        lr_at(1, schedule="cosin", lr=1.0, warmup=0, max_steps=1)


def test_trainer_sets_the_scheduled_lr(tmp_path, make_gpt, toy_data, cfg_factory):
    from qkv.train import LambdaCallback, Trainer

    seen = []
    cb = LambdaCallback(on_after_backward=lambda tr, step: seen.append(tr.optimizer.param_groups[0]["lr"]))
    cfg = cfg_factory(max_steps=5, schedule="noam", lr=2.0, warmup=3)
    Trainer(make_gpt(), cfg, toy_data, callbacks=[cb]).fit()
    want = [2.0 * 32 ** -0.5 * min(s ** -0.5, s * 3 ** -1.5) for s in range(1, 6)]
    assert seen == pytest.approx(want, rel=1e-12)
