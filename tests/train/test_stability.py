"""NaN policies (skip / stop / rollback) by injection, length truncation with a counted warning."""

import json
import math

import pytest
import torch

from qkv.train import (
    Callback,
    LengthTruncationWarning,
    NonFiniteError,
    Trainer,
    list_checkpoints,
    lr_at,
    truncate_batch,
)

BAD_LAYER = "decoder.blocks.1.ffn.up"


class NanGrad(Callback):
    """Poison one layer's gradient at the given steps (as a blow-up inside that layer would)."""

    def __init__(self, steps):
        self.steps = set(steps)

    def on_after_backward(self, trainer, step):
        if step in self.steps:
            trainer.model.get_submodule(BAD_LAYER).weight.grad[0, 0] = float("nan")


class InfWeightOnce(Callback):
    """Make the forward produce a NaN loss once (a weight set to inf), at the given step."""

    def __init__(self, step):
        self.step, self.done = step, False

    def on_step_start(self, trainer, step):
        if step == self.step and not self.done:
            self.done = True
            with torch.no_grad():
                trainer.model.get_submodule("decoder.blocks.0.attn.qkv_proj").weight[0, 0] = float("inf")


class Snapshots(Callback):
    def __init__(self):
        self.after = {}

    def on_step_end(self, trainer, step, record):
        self.after[step] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_skip_drops_the_update(make_gpt, toy_data, cfg_factory):
    snaps = Snapshots()
    tr = Trainer(make_gpt(), cfg_factory(max_steps=5, nan_policy="skip"), toy_data,
                 callbacks=[NanGrad([3]), snaps])
    s = tr.fit()
    assert s["skipped"] == 1 and s["steps"] == 5
    assert 3 not in snaps.after  # no successful update 3
    # update 4 starts from the weights after update 2, and everything stays finite
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())
    assert any(not torch.equal(snaps.after[2][n], p) for n, p in snaps.after[4].items())


def test_skip_limit_stops(make_gpt, toy_data, cfg_factory):
    with pytest.raises(NonFiniteError):
        Trainer(make_gpt(), cfg_factory(max_steps=6, nan_policy="skip", max_skips=1), toy_data,
                callbacks=[NanGrad([2, 3])]).fit()


def test_stop_saves_checkpoint_and_batch_and_names_layer(tmp_path, make_gpt, toy_data, cfg_factory):
    with pytest.raises(NonFiniteError) as info:
        Trainer(make_gpt(), cfg_factory(max_steps=6, nan_policy="stop", batch_size=4, grad_accum=2), toy_data,
                callbacks=[NanGrad([3])]).fit()
    err = info.value
    assert err.step == 3 and err.layers == [BAD_LAYER]
    msg = str(err)
    assert "step 3" in msg and BAD_LAYER in msg and "non-finite gradient" in msg
    # the checkpoint holds the weights before the bad update (2 good updates), finite
    assert err.checkpoint.name == "step_00000002"
    from qkv.train import read_checkpoint

    weights, state = read_checkpoint(err.checkpoint)
    assert state["step"] == 2 and all(torch.isfinite(v).all() for v in weights.values())
    # the offending micro-batches, loadable without pickle, equal what the source gives for step 3
    saved = torch.load(err.batch_path, weights_only=True)
    assert len(saved) == 2
    for micro, b in enumerate(saved):
        want = toy_data.batch(2 * 2 + micro, 4)
        assert all(torch.equal(b[k], want[k]) for k in want)
    log = (tmp_path / "run" / "train.log").read_text()
    assert "non-finite gradient at step 3" in log


def test_stop_on_nan_loss_reports_loss(make_gpt, toy_data, cfg_factory):
    with pytest.raises(NonFiniteError, match="non-finite loss at step 2") as info:
        Trainer(make_gpt(), cfg_factory(max_steps=4), toy_data, callbacks=[InfWeightOnce(2)]).fit()
    assert math.isnan(info.value.loss)


def test_rollback_reloads_and_lowers_lr(tmp_path, make_gpt, toy_data, cfg_factory):
    tr = Trainer(make_gpt(), cfg_factory(max_steps=8, nan_policy="rollback", save_every=2, warmup=0,
                                         schedule="cosine", lr=1e-3), toy_data, callbacks=[InfWeightOnce(5)])
    s = tr.fit()
    assert s["rollbacks"] == 1 and s["steps"] == 8 and math.isfinite(s["final_loss"])
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in records}  # the last record of a step wins
    for step in (5, 6, 7, 8):  # after rolling back to step 4: half the scheduled LR
        assert (lrs[step]
                == pytest.approx(0.5 * lr_at(step, schedule="cosine", lr=1e-3, warmup=0, max_steps=8)))
    assert lrs[3] == pytest.approx(lr_at(3, schedule="cosine", lr=1e-3, warmup=0, max_steps=8))
    assert "rolled back to step_00000004" in (tmp_path / "run" / "train.log").read_text()


def test_rollback_without_checkpoint_uses_initial_state(tmp_path, make_gpt, toy_data, cfg_factory):
    tr = Trainer(make_gpt(), cfg_factory(max_steps=3, nan_policy="rollback"), toy_data,
                 callbacks=[InfWeightOnce(2)])
    assert tr.fit()["rollbacks"] == 1
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")][0] == 0


def test_rollback_limit(make_gpt, toy_data, cfg_factory):
    with pytest.raises(NonFiniteError, match="rollback, limit reached"):
        Trainer(make_gpt(), cfg_factory(max_steps=6, nan_policy="rollback", max_rollbacks=2, save_every=1),
                toy_data, callbacks=[NanGrad([3])]).fit()


def test_truncate_batch_counts_and_warns():
    batch = {"input_ids": torch.ones(2, 40, dtype=torch.long), "labels": torch.ones(2, 40, dtype=torch.long),
             "attention_mask": torch.ones(2, 40), "extra": torch.ones(2, 40)}
    with pytest.warns(LengthTruncationWarning, match="input_ids \\(40 -> 32\\)"):
        out, n = truncate_batch(batch, 32)
    assert n == 3 and out["input_ids"].shape == (2, 32) and out["extra"].shape == (2, 40)
    same, n0 = truncate_batch(batch, 64)
    assert n0 == 0 and same["input_ids"].shape == (2, 40)


def test_trainer_truncates_to_context_with_warning(make_gpt, cfg_factory):
    from _toy import ToyLM

    long = ToyLM(max_len=40, min_len=36)  # every sequence exceeds the context of 32
    with pytest.warns(LengthTruncationWarning):
        s = Trainer(make_gpt(), cfg_factory(max_steps=2), long).fit()
    assert s["truncated"] == 2 * 3  # input_ids, labels, attention_mask cut at each of 2 steps


# -- clear ends instead of endless skipping or duplicated records ------------------------
def test_skip_policy_gives_up_by_default(make_gpt, toy_data, cfg_factory):
    from qkv.train import TrainConfig

    assert TrainConfig().max_skips is not None  # the default is a limit, not "skip forever"
    every = list(range(1, 40))
    with pytest.raises(NonFiniteError, match="skip, limit reached"):
        Trainer(make_gpt(), cfg_factory(max_steps=30, nan_policy="skip"), toy_data,
                callbacks=[NanGrad(every)]).fit()


def test_rollback_leaves_one_record_per_step(tmp_path, make_gpt, toy_data, cfg_factory):
    # NaN at step 7, newest checkpoint at 4: steps 5 and 6 are done (and logged) twice
    Trainer(make_gpt(), cfg_factory(max_steps=8, nan_policy="rollback", save_every=4, warmup=0), toy_data,
            callbacks=[InfWeightOnce(7)]).fit()
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))


def test_rollback_limit_keeps_metrics_consistent(tmp_path, make_gpt, toy_data, cfg_factory):
    with pytest.raises(NonFiniteError, match="rollback, limit reached"):
        Trainer(make_gpt(), cfg_factory(max_steps=8, nan_policy="rollback", save_every=4), toy_data,
                callbacks=[NanGrad([7])]).fit()  # NaN at step 7 every time: 3 rollbacks to step 4, then stop
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("field, value",
                         [("lr", float("inf")), ("lr", float("nan")), ("min_lr", float("inf")),
                                          ("clip_grad", float("inf")), ("eps", float("nan")),
                                          ("weight_decay", float("inf")), ("warmup", float("inf")),
                                          ("max_skips", -1), ("save_every", -1)])
def test_non_finite_and_negative_settings_are_rejected(field, value):
    from qkv.config import ConfigError
    from qkv.train import TrainConfig

    with pytest.raises(ConfigError, match=field):
        TrainConfig(**{field: value}).validate()
