"""SIGINT / SIGTERM during training: a checkpoint at the end of the current step, then a clean stop that a
resume continues exactly."""

import os
import signal

import pytest

from qkv.train import Callback, LambdaCallback, Trainer, TrainingInterrupted, latest_checkpoint


class SendSignal(Callback):
    def __init__(self, step, sig):
        self.step, self.sig = step, sig

    def on_step_start(self, trainer, step):
        if step == self.step:  # arrives mid-step, before the batch: the step still completes
            os.kill(os.getpid(), self.sig)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_checkpoints_the_current_step_and_resume_continues(tmp_path, make_gpt, toy_data, cfg_factory,
                                                                  sig):
    full = {}
    Trainer(make_gpt(dropout=0.1), cfg_factory(max_steps=6, out_dir=str(tmp_path / "ref")), toy_data,
            callbacks=[LambdaCallback(on_step_end=lambda tr, s, r: full.__setitem__(s, r["loss"]))]).fit()

    part = {}
    rec = LambdaCallback(on_step_end=lambda tr, s, r: part.__setitem__(s, r["loss"]))
    before = signal.getsignal(sig)
    with pytest.raises(TrainingInterrupted) as info:  # save_every=0: only the signal makes a checkpoint
        Trainer(make_gpt(dropout=0.1), cfg_factory(max_steps=6, save_every=0), toy_data,
                callbacks=[SendSignal(3, sig), rec]).fit()
    assert signal.getsignal(sig) == before  # the handler is removed again
    err = info.value
    assert err.signum == sig and err.step == 3 and isinstance(err, KeyboardInterrupt)
    root = tmp_path / "run" / "checkpoints"
    assert latest_checkpoint(root).name == "step_00000003" and err.checkpoint == latest_checkpoint(root)
    assert sorted(part) == [1, 2, 3]
    Trainer(make_gpt(dropout=0.1), cfg_factory(max_steps=6, resume=True), toy_data,
            callbacks=[LambdaCallback(on_step_end=lambda tr, s, r: part.__setitem__(s, r["loss"]))]).fit()
    assert part == full  # bit-identical continuation


def test_default_save_interval():
    from qkv.train import TrainConfig

    assert TrainConfig().save_every > 0  # a hard kill loses at most this many steps
