"""metrics.jsonl / csv / curves.png / TensorBoard / diagnostics, seeding, eval isolation."""

import csv
import json
import math
import random

import numpy as np
import pytest
import torch

from qkv.train import LambdaCallback, Trainer, seed_everything


def test_run_files(tmp_path, make_gpt, toy_data, cfg_factory):
    pytest.importorskip("tensorboard")
    cfg = cfg_factory(max_steps=6, log_every=2, diag_every=3, eval_every=3, max_eval_batches=2, plot=True,
                      tensorboard=True, clip_grad=None)
    norms = {}
    cb = LambdaCallback(on_after_backward=lambda tr, step: norms.__setitem__(
        step, float(torch.linalg.vector_norm(
            torch.cat([p.grad.flatten() for p in tr.model.parameters() if p.grad is not None])))))
    s = Trainer(make_gpt(), cfg, toy_data, callbacks=[cb]).fit()
    run = tmp_path / "run"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 6]  # log_every=2, plus step 1 and eval steps
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= r.keys()
        assert r["tokens_per_s"] > 0 and math.isfinite(r["loss"])
        assert r["grad_norm"] == pytest.approx(norms[r["step"]], rel=1e-5)  # pre-clip global norm
    assert "eval/loss" in records[2] and "eval/loss" in records[4]
    assert s["eval"]["loss"] == records[4]["eval/loss"]
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 5 and list(rows[0])[:5] == ["step", "loss", "lr", "grad_norm", "tokens_per_s"]
    assert float(rows[1]["loss"]) == records[1]["loss"]
    assert (run / "curves.png").stat().st_size > 1000
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    # per-layer norms: their squares add up to the global grad norm of the same step
    diag = [json.loads(x) for x in (run / "diagnostics.jsonl").read_text().splitlines()]
    assert [d["step"] for d in diag] == [3, 6]
    for d in diag:
        layers = [k for k in d if k.startswith("grad/")]
        assert "grad/decoder.blocks.0" in layers and "grad/decoder.blocks.1" in layers
        assert math.sqrt(sum(d[k] ** 2 for k in layers)) == pytest.approx(norms[d["step"]], rel=1e-4)
        assert "weight/tok_emb" in d


def test_eval_does_not_perturb_training(tmp_path, make_gpt, toy_data, cfg_factory):
    def eval_fn(model):  # an eval that draws random numbers (sampling, dropout in a task's decode, ...)
        torch.rand(10)
        random.random()
        np.random.rand()
        return {"loss": 1.0}

    runs = []
    for i, fn in enumerate([None, eval_fn]):
        losses = []
        cb = LambdaCallback(on_step_end=lambda tr, step, rec, losses=losses: losses.append(rec["loss"]))
        Trainer(make_gpt(dropout=0.2), cfg_factory(max_steps=4, eval_every=1 if fn else 0,
                                                   out_dir=str(tmp_path / str(i))), toy_data,
                eval_fn=fn, callbacks=[cb]).fit()
        runs.append(losses)
    assert runs[0] == runs[1]


def test_seed_everything_is_deterministic():
    def draw():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    seed_everything(7)
    a = draw()
    seed_everything(7)
    assert draw() == a
    seed_everything(8)
    assert draw() != a


def test_training_reduces_loss(make_gpt, toy_data, cfg_factory):
    # the toy sequences are "previous + 1": a working loop learns them quickly
    s = Trainer(make_gpt(), cfg_factory(max_steps=60, batch_size=16, lr=1e-2, warmup=4, log_every=60),
                toy_data, eval_fn=None).fit()
    assert s["final_loss"] < 1.0  # from ln(32) = 3.47


def test_resume_appends_to_metrics_never_rewrites(tmp_path, make_gpt, toy_data, cfg_factory, monkeypatch):
    from qkv.train import StopAt
    from qkv.train import logging as tlog

    Trainer(make_gpt(), cfg_factory(max_steps=8, save_every=2), toy_data, callbacks=[StopAt(5)]).fit()
    path = tmp_path / "run" / "metrics.jsonl"
    before = path.read_bytes()
    assert [json.loads(x)["step"] for x in before.decode().splitlines()] == [1, 2, 3, 4, 5]

    class Killed(BaseException):
        pass

    def die(*a, **k):
        raise Killed()

    # a kill while the resumed run sets up its log must not empty the log
    monkeypatch.setattr(tlog.json, "dumps", die)
    with pytest.raises(Killed):
        Trainer(make_gpt(), cfg_factory(max_steps=8, save_every=2, resume=True), toy_data).fit()
    monkeypatch.undo()
    after = path.read_bytes()
    assert after and before.startswith(after)  # a prefix of the old file: at most the abandoned steps cut off
    # a line cut by a kill mid-write is dropped, and records after the resumed step too; the rest stays
    # byte-identical
    with open(path, "ab") as f:
        f.write(b'{"step": 6, "lo')
    Trainer(make_gpt(), cfg_factory(max_steps=8, save_every=2, resume=True), toy_data).fit()
    lines = path.read_bytes().decode().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert path.read_bytes().startswith(before)  # resumed at step 5: its record stays, byte for byte


@pytest.mark.parametrize("progress", [False, True])
def test_a_line_per_logged_step_without_a_progress_bar(tmp_path, make_gpt, toy_data, cfg_factory, capsys,
                                                       progress):
    """Without a drawn bar (progress off, or output not a terminal: pytest's is not) every logged step is a
    line on stdout and in train.log; a run sent to a file said nothing until its first evaluation."""
    cfg = cfg_factory(max_steps=5, log_every=2, progress=progress, eval_every=0, plot=False,
                      tensorboard=False)
    Trainer(make_gpt(), cfg, toy_data).fit()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert [ln.split(":")[0] for ln in lines] == ["step 1/5", "step 2/5", "step 4/5", "step 5/5"]
    assert "loss" in lines[0] and "tokens/s" in lines[0]
    log = (tmp_path / "run" / "train.log").read_text()
    assert all(ln in log for ln in lines)
