"""The training loop on a tiny MLP (fast), resumes and contracts: best-checkpoint bookkeeping across rollbacks
and resumes, what a stopped run logs, config checks on a directly built TrainConfig, the model's return types
and the callbacks' contract."""

from __future__ import annotations

import json
import types

import pytest
import torch
from torch import nn

from qkv.train import TrainConfig, Trainer


class Out:
    def __init__(self, loss, n_targets):
        self.loss, self.n_targets = loss, n_targets


class MLP(nn.Module):
    """forward(x, y) -> Out(mean cross-entropy, targets); `nan_at`: the n-th training forward's loss is
    NaN."""

    def __init__(self, d: int = 8, nan_at: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc, self.head = nn.Embedding(10, d), nn.Linear(d, d), nn.Linear(d, 10)
        self.nan_at, self.calls = nan_at, 0

    def loss(self, x, y):
        h = self.head(torch.relu(self.fc(self.emb(x))))
        return nn.functional.cross_entropy(h.view(-1, 10), y.view(-1))

    def forward(self, x, y):
        loss = self.loss(x, y)
        if self.training:
            self.calls += 1
            if self.calls == self.nan_at:
                loss = loss * float("nan")
        return Out(loss, y.numel())


class Data:
    def batch(self, index, batch_size, split="train"):
        g = torch.Generator().manual_seed(index + (10**6 if split == "val" else 0))
        x = torch.randint(0, 10, (batch_size, 4), generator=g)
        return {"x": x, "y": (x + 1) % 10}


def cfg(tmp_path, **kw) -> TrainConfig:
    d = dict(max_steps=5, batch_size=4, out_dir=str(tmp_path / "run"), progress=False, tensorboard=False,
             plot=False, log_every=1, warmup=0, schedule="constant", lr=1e-2)
    d.update(kw)
    return TrainConfig(**d)


def logged(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_a_rollback_keeps_the_best_found_after_the_checkpoint_it_returns_to(tmp_path):
    # best at step 6 (0.9); step 7 is NaN -> back to step 4's checkpoint; the replayed step 6 scores 0.6
    trainers = []

    def acc(model):
        t = trainers[0]
        return {"acc": {2: 0.5, 4: 0.4, 6: 0.9 if t.state.counters.rollbacks == 0 else 0.6, 8: 0.3}[t.step]}

    c = cfg(tmp_path, max_steps=8, eval_every=2, save_every=4, nan_policy="rollback", best_metric="acc",
            best_mode="max")
    t = Trainer(MLP(nan_at=7), c, Data(), eval_fn=acc)
    trainers.append(t)
    s = t.fit()
    assert s["rollbacks"] == 1
    assert s["best_eval"]["value"] == 0.9 and s["best_eval"]["step"] == 6
    assert json.loads((tmp_path / "run/checkpoints/best/eval.json").read_text())["acc"] == 0.9


def test_resume_keeps_a_best_newer_than_the_step_checkpoint(tmp_path):
    # steps 1..4 with a checkpoint at 2 only; the best (step 3) is newer than it. The resumed run replays
    # steps 3..4 with worse scores: checkpoints/best must stay step 3's
    scores = {1: 0.5, 2: 0.4, 3: 0.1, 4: 0.3}
    trainers = []

    def ev(model):
        return {"loss": scores[trainers[-1].step]}

    class Crash(Exception):
        pass

    t = Trainer(MLP(), cfg(tmp_path, max_steps=4, eval_every=1, save_every=2), Data(), eval_fn=ev)
    trainers.append(t)
    real_save = t.save_checkpoint

    def save(folder=None, extra=None, **kw):  # a hard kill after step 3: no checkpoint past step 2
        if folder is None and t.step > 2:
            raise Crash
        return real_save(folder, extra, **kw)

    t.save_checkpoint = save
    with pytest.raises(Crash):
        t.fit()
    scores.update({3: 0.6, 4: 0.7})
    t2 = Trainer(MLP(), cfg(tmp_path, max_steps=4, eval_every=1, save_every=2, resume=True), Data(),
                 eval_fn=ev)
    trainers.append(t2)
    s = t2.fit()
    assert s["best_eval"] == {"metric": "loss", "value": 0.1, "step": 3}
    assert json.loads((tmp_path / "run/checkpoints/best/eval.json").read_text())["step"] == 3


@pytest.mark.parametrize("bad,field", [
    ({"best_mode": "Min"}, "best_mode"), ({"nan_policy": "skp"}, "nan_policy"),
    ({"schedule": "cosin"}, "schedule"),
    ({"precision": "bf-16"}, "precision"), ({"distributed": "dpp"}, "distributed"),
    ({"optimizer_impl": "fast"}, "optimizer_impl"), ({"max_steps": "10"}, "max_steps"),
    ({"max_steps": 2.5}, "max_steps"), ({"compile": "no"}, "compile"), ({"betas": 0.9}, "betas")])
def test_a_directly_built_train_config_is_checked_like_a_mapping(tmp_path, bad, field):
    from qkv.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match=f"TrainConfig.{field}") as direct:
        cfg(tmp_path, **bad).validate()
    with pytest.raises(ConfigError) as mapped:
        from_dict(TrainConfig, bad)
    assert str(direct.value) == str(mapped.value)  # one rule, one message


def test_a_directly_built_train_config_is_normalised_like_a_mapping(tmp_path):
    c = cfg(tmp_path, max_steps=3.0, betas=(0.9, 0.95))
    c.validate()
    assert c.max_steps == 3 and type(c.max_steps) is int and c.betas == [0.9, 0.95]


def test_heldout_loss_of_a_model_without_n_targets_weighs_batches_by_rows(tmp_path):
    class NoCount(MLP):  # as a Hugging Face model's output: a loss, no n_targets
        def forward(self, x, y):
            return types.SimpleNamespace(loss=super().forward(x, y).loss)

    model = NoCount()
    s = Trainer(model, cfg(tmp_path, max_eval_batches=3, max_steps=2), Data()).fit()
    model.eval()
    with torch.no_grad():  # every val batch has 4 rows: the row-weighted mean is the plain mean
        want = sum(float(model.loss(**Data().batch(i, 4, "val"))) for i in range(3)) / 3
    assert s["eval"]["loss"] == pytest.approx(want, rel=1e-6)


def test_resuming_a_finished_run_whose_last_loss_was_nan(tmp_path):
    c = dict(max_steps=4, nan_policy="skip")
    Trainer(MLP(nan_at=4), cfg(tmp_path, **c), Data()).fit()  # step 4 skipped: logs loss "nan"
    assert logged(tmp_path)[-1]["loss"] == "nan"
    s = Trainer(MLP(), cfg(tmp_path, resume=True, **c), Data()).fit()
    assert s["steps"] == 4 and isinstance(s["final_loss"], float)


def test_a_run_stopped_by_a_callback_logs_its_last_step_and_resumes_with_its_loss(tmp_path):
    from qkv.train import StopAt

    s = Trainer(MLP(), cfg(tmp_path, max_steps=20, log_every=10), Data(), callbacks=[StopAt(7)]).fit()
    assert s["steps"] == 7
    assert [r["step"] for r in logged(tmp_path)] == [1, 7]
    assert logged(tmp_path)[-1]["loss"] == pytest.approx(s["final_loss"])
    again = Trainer(MLP(), cfg(tmp_path, max_steps=7, log_every=10, resume=True), Data()).fit()
    assert again["steps"] == 7 and again["final_loss"] == pytest.approx(s["final_loss"])


def test_a_run_stopped_by_a_signal_logs_its_last_step(tmp_path):
    import os
    import signal

    from qkv.train import LambdaCallback, TrainingInterrupted

    def send(trainer, step, micro, batch):
        if step == 7:
            os.kill(os.getpid(), signal.SIGINT)
        return batch

    with pytest.raises(TrainingInterrupted):
        Trainer(MLP(), cfg(tmp_path, max_steps=20, log_every=10), Data(),
                callbacks=[LambdaCallback(on_batch=send)]).fit()
    assert [r["step"] for r in logged(tmp_path)] == [1, 7]


def test_an_exception_in_eval_fn_keeps_the_steps_done_and_a_resume_continues(tmp_path):
    from qkv.train import latest_checkpoint

    trainers = []

    def ev(model):
        if trainers[0].step == 6:
            raise ZeroDivisionError("metric bug")
        return {"loss": 1.0}

    t = Trainer(MLP(), cfg(tmp_path, max_steps=8, eval_every=3, save_every=4), Data(), eval_fn=ev)
    trainers.append(t)
    with pytest.raises(ZeroDivisionError, match="metric bug"):  # the original exception, unmasked
        t.fit()
    assert latest_checkpoint(tmp_path / "run/checkpoints").name.endswith("00000006")
    s = Trainer(MLP(), cfg(tmp_path, max_steps=8, save_every=4, resume=True), Data()).fit()
    assert s["steps"] == 8


def test_resume_without_a_checkpoint_says_it_starts_fresh(tmp_path):
    with pytest.warns(UserWarning, match="holds no checkpoint: starting fresh"):
        s = Trainer(MLP(), cfg(tmp_path, max_steps=2, resume=True), Data()).fit()
    assert s["steps"] == 2
    assert "starting fresh" in (tmp_path / "run/train.log").read_text()


def test_fit_again_on_the_same_trainer_continues_its_own_run(tmp_path):
    import os
    import signal

    from qkv.train import LambdaCallback, TrainingInterrupted

    def send(trainer, step, micro, batch):
        if step == 3 and not sent:
            sent.append(step)
            os.kill(os.getpid(), signal.SIGINT)
        return batch

    sent: list[int] = []
    t = Trainer(MLP(), cfg(tmp_path, max_steps=6), Data(), callbacks=[LambdaCallback(on_batch=send)])
    with pytest.raises(TrainingInterrupted):
        t.fit()
    s = t.fit()  # a notebook's second run of the cell
    assert s["steps"] == 6 and [r["step"] for r in logged(tmp_path)] == [1, 2, 3, 4, 5, 6]
    ref = Trainer(MLP(), cfg(tmp_path / "ref", max_steps=6), Data()).fit()
    # the same run as one uninterrupted fit
    assert s["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-6)
    assert t.fit()["steps"] == 6  # and once more after it finished: nothing to do


@pytest.mark.parametrize("returns", ["tensor", "dict"])
def test_a_model_returning_its_loss_as_a_tensor_or_a_dict_trains(tmp_path, returns):
    class Plain(MLP):
        def forward(self, x, y):
            loss = super().forward(x, y).loss
            return loss if returns == "tensor" else {"loss": loss}

    s = Trainer(Plain(), cfg(tmp_path, max_steps=3, max_eval_batches=2), Data()).fit()
    ref = Trainer(MLP(), cfg(tmp_path / "ref", max_steps=3, max_eval_batches=2), Data()).fit()
    # rows weigh the loss instead of targets: every batch has 4 rows of 4 targets, so the same updates
    assert s["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-6)
    assert s["eval"]["loss"] == pytest.approx(ref["eval"]["loss"], rel=1e-6)


def test_a_model_returning_no_loss_is_told_the_contract(tmp_path):
    class Logits(MLP):
        def forward(self, x, y):
            return self.head(self.emb(x))

    with pytest.raises(ValueError,
                       match=r"returned a tensor of shape \(4, 4, 10\) without a loss: it must return"):
        Trainer(Logits(), cfg(tmp_path, max_steps=1), Data()).fit()


def test_an_on_batch_callback_may_change_the_batch_in_place_and_return_none(tmp_path):
    from qkv.train import LambdaCallback

    def shift(trainer, step, micro, batch):
        batch["y"] = (batch["x"] + 2) % 10  # in place; returns None

    class Shifted(Data):
        def batch(self, index, batch_size, split="train"):
            b = super().batch(index, batch_size, split)
            return {"x": b["x"], "y": (b["x"] + 2) % 10}

    s = Trainer(MLP(), cfg(tmp_path, max_steps=3), Data(), callbacks=[LambdaCallback(on_batch=shift)]).fit()
    ref = Trainer(MLP(), cfg(tmp_path / "ref", max_steps=3), Shifted()).fit()
    assert s["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-6)  # the change took effect


def test_max_eval_batches_reaches_an_eval_fn_that_names_it(tmp_path):
    got = []

    def ev(model, max_eval_batches=None):
        got.append(max_eval_batches)
        return {"loss": 1.0}

    Trainer(MLP(), cfg(tmp_path, max_eval_batches=7, max_steps=1), Data(), eval_fn=ev).fit()
    # not named
    Trainer(MLP(), cfg(tmp_path / "b", max_steps=1), Data(), eval_fn=lambda m: {"loss": 1.0}).fit()
    assert got == [7]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "inverse_sqrt"])
def test_a_warmup_as_long_as_the_run_is_flagged_for_every_warming_schedule(tmp_path, schedule):
    from qkv.train import lr_at

    c = cfg(tmp_path, max_steps=4, warmup=8, schedule=schedule, lr=1.0)
    # the fact
    assert max(lr_at(s, schedule=schedule, lr=1.0, warmup=8, max_steps=4) for s in range(1, 5)) < 1.0
    with pytest.warns(UserWarning, match=f"the {schedule} schedule never reaches train.lr"):
        Trainer(MLP(), c, Data())


def test_noam_with_a_long_warmup_is_not_flagged(tmp_path, recwarn):
    import warnings

    class WithDModel(MLP):
        config = types.SimpleNamespace(d_model=8)

    warnings.simplefilter("always")
    Trainer(WithDModel(), cfg(tmp_path, max_steps=4, warmup=8, schedule="noam"), Data())
    assert not [w for w in recwarn if "warmup" in str(w.message)]


def test_a_path_out_dir_and_a_torch_device_are_accepted(tmp_path):
    # the type checks of a directly built TrainConfig refused the two most natural values from Python
    c = cfg(tmp_path / "run", max_steps=1)
    c.out_dir, c.device = tmp_path / "run", torch.device("cpu")
    c.validate()
    assert c.out_dir == str(tmp_path / "run") and c.device == "cpu"
    Trainer(MLP(), c, Data()).fit()
    assert (tmp_path / "run" / "checkpoints").is_dir()
