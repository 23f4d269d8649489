"""Save/resume: exact continuation, atomic writes, keep-last/best, folders that rebuild their model."""

import json
import os
import time

import pytest
import torch

import qkv
from qkv.train import LambdaCallback, StopAt, Trainer, latest_checkpoint, list_checkpoints, read_checkpoint
from qkv.train import checkpoint as tckpt


def loss_recorder():
    losses = {}
    return losses, LambdaCallback(on_step_end=lambda tr, step, rec: losses.__setitem__(step, rec["loss"]))


def test_resume_is_bit_identical(tmp_path, make_gpt, toy_data, cfg_factory):
    # dropout > 0 so the RNG state must be restored exactly, AdamW moments too
    n = 4
    full, cb = loss_recorder()
    Trainer(make_gpt(dropout=0.1), cfg_factory(max_steps=2 * n, out_dir=str(tmp_path / "a")), toy_data,
            callbacks=[cb]).fit()

    first, cb1 = loss_recorder()
    s1 = Trainer(make_gpt(dropout=0.1), cfg_factory(max_steps=2 * n, out_dir=str(tmp_path / "b")), toy_data,
                 callbacks=[cb1, StopAt(n)]).fit()
    assert s1["steps"] == n and latest_checkpoint(tmp_path / "b" / "checkpoints").name == f"step_{n:08d}"
    second, cb2 = loss_recorder()
    model = make_gpt(seed=123, dropout=0.1)  # different init: everything must come from the checkpoint
    tr2 = Trainer(model, cfg_factory(max_steps=2 * n, out_dir=str(tmp_path / "b"), resume=True), toy_data,
                  callbacks=[cb2])
    s2 = tr2.fit()
    assert s2["steps"] == 2 * n and sorted(second) == list(range(n + 1, 2 * n + 1))
    assert {**first, **second} == full  # exact float equality, step by step
    # the default AdamW on CPU is the fused kernel, and the resumed optimizer still runs it
    assert (tr2.optimizer_impl == "fused"
            and all(g["fused"] and not g["foreach"] for g in tr2.optimizer.param_groups))

    # metrics.jsonl of the resumed run describes one run: steps 1..2n once each
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 2 * n + 1))


def test_checkpoint_folder_rebuilds_model(tmp_path, make_gpt, toy_data, cfg_factory):
    model = make_gpt()
    Trainer(model, cfg_factory(max_steps=2), toy_data).fit()
    folder = latest_checkpoint(tmp_path / "run" / "checkpoints")
    loaded = qkv.from_pretrained(folder)
    assert type(loaded).__name__ == "GPT" and loaded.config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    # training state loads with weights_only=True (no pickled code)
    state = torch.load(folder / "train_state.pt", weights_only=True)
    assert state["step"] == 2 and "exp_avg" in next(iter(state["optimizer"]["state"].values()))


def test_killed_save_leaves_previous_checkpoint(tmp_path, make_gpt, toy_data, cfg_factory, monkeypatch):
    calls = {"n": 0}
    real = tckpt._torch_save

    def dying_save(obj, path):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint dies after its weights were written
            raise KeyboardInterrupt("killed mid-save")
        real(obj, path)

    monkeypatch.setattr(tckpt, "_torch_save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        Trainer(make_gpt(), cfg_factory(max_steps=6, save_every=2), toy_data).fit()
    root = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in list_checkpoints(root)] == [2]
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # the temp folder was removed
    read_checkpoint(root / "step_00000002")
    qkv.from_pretrained(root / "step_00000002")

    # a hard kill cannot clean up: a stale temp folder with partial files is ignored, then removed
    stale = root / ".step_00000004.abc.tmp"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(root).name == "step_00000002"
    monkeypatch.setattr(tckpt, "_torch_save", real)
    s = Trainer(make_gpt(), cfg_factory(max_steps=4, save_every=2, resume=True), toy_data).fit()
    assert s["steps"] == 4 and not stale.exists()


def test_keep_last_and_best(tmp_path, make_gpt, toy_data, cfg_factory):
    # an eval whose metric is best at step 4 of 10
    values = {2: 5.0, 4: 1.0, 6: 3.0, 8: 2.0, 10: 4.0}
    holder = {}

    def eval_fn(model):
        return {"loss": values[holder["tr"].step], "acc": 0.5}

    tr = Trainer(make_gpt(), cfg_factory(max_steps=10, save_every=2, eval_every=2, keep_last=2), toy_data,
                 eval_fn=eval_fn)
    holder["tr"] = tr
    s = tr.fit()
    root = tmp_path / "run" / "checkpoints"
    assert [st for st, _ in list_checkpoints(root)] == [8, 10]
    assert s["best_eval"] == {"metric": "loss", "value": 1.0, "step": 4}
    best = json.loads((root / "best" / "eval.json").read_text())
    assert best["step"] == 4 and best["loss"] == 1.0
    _, state = read_checkpoint(root / "best")
    assert state["step"] == 4
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/loss"] for r in records if "eval/loss" in r] == [5.0, 1.0, 3.0, 2.0, 4.0]


def test_wrong_checkpoint_is_clear_error(tmp_path, make_gpt, toy_data, cfg_factory):
    Trainer(make_gpt(), cfg_factory(max_steps=1), toy_data).fit()
    bigger = make_gpt(d_model=64)
    with pytest.raises(qkv.checkpoint.CheckpointError, match="shape"):
        Trainer(bigger, cfg_factory(max_steps=2, resume=True), toy_data).fit()


def test_compiled_model_checkpoint_has_no_orig_mod(tmp_path, make_gpt, toy_data, cfg_factory):
    tr = Trainer(make_gpt(), cfg_factory(compile=True), toy_data)
    assert hasattr(tr.engine, "_orig_mod")  # really wrapped (compilation itself is lazy)
    folder = tr.save_checkpoint()
    weights, state = read_checkpoint(folder)
    keys = list(weights) + list(state["optimizer"]["state"])
    assert keys and not [k for k in keys if "_orig_mod" in k or k.startswith("module.")]
    qkv.from_pretrained(folder)


@pytest.mark.slow
def test_compile_trains_same_as_eager(tmp_path, make_gpt, toy_data, cfg_factory):
    if os.environ.get("QKV_TEST_COMPILE") != "1":
        pytest.skip("torch.compile on this shared 2-core CPU takes minutes (Inductor C++ builds); "
                    "set QKV_TEST_COMPILE=1 to run")
    t0 = time.perf_counter()
    eager, cb_e = loss_recorder()
    Trainer(make_gpt(), cfg_factory(max_steps=3, out_dir=str(tmp_path / "e")), toy_data,
            callbacks=[cb_e]).fit()
    comp, cb_c = loss_recorder()
    Trainer(make_gpt(), cfg_factory(max_steps=3, compile=True, out_dir=str(tmp_path / "c")), toy_data,
            callbacks=[cb_c]).fit()
    assert list(comp.values()) == pytest.approx(list(eager.values()), rel=1e-4)
    print(f"compile run took {time.perf_counter() - t0:.0f}s")


# -- kills at the worst moments -----------------------------------------------
class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (not even `finally: cleanup` that catches Exception)."""


def test_kill_during_pruning_leaks_no_folder(tmp_path, make_gpt, toy_data, cfg_factory, monkeypatch):
    import shutil

    real_rmtree = shutil.rmtree
    state = {"armed": True}

    def dying_rmtree(path, *a, **k):
        # delete one file of the doomed folder, then die: a half-deleted folder, as a kill mid-prune leaves
        if state["armed"]:
            state["armed"] = False
            os.unlink(os.path.join(path, "model.safetensors"))
            raise Killed()
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(tckpt.shutil, "rmtree", dying_rmtree)
    with pytest.raises(Killed):
        Trainer(make_gpt(), cfg_factory(max_steps=8, save_every=1, keep_last=2), toy_data).fit()
    monkeypatch.setattr(tckpt.shutil, "rmtree", real_rmtree)
    root = tmp_path / "run" / "checkpoints"
    # the next start (a resume) cleans up, and prunes down to keep_last
    Trainer(make_gpt(), cfg_factory(max_steps=8, save_every=1, keep_last=2, resume=True), toy_data).fit()
    assert sorted(p.name for p in root.iterdir()) == ["step_00000007", "step_00000008"]


def test_kill_between_the_renames_of_best_keeps_a_best(tmp_path, make_gpt, toy_data, cfg_factory,
                                                       monkeypatch):
    values = iter([3.0, 2.0, 1.0, 0.5])
    real_replace = os.replace
    calls = {"n": 0}

    def dying_replace(src, dst):
        # the second best/ replacement dies after moving the old best aside, before the new one is in place
        if str(dst).endswith("best") or ".best.old" in str(dst):
            calls["n"] += 1
            if calls["n"] == 3:  # 1: first best (no old one); 2: old aside; 3: new into place -> killed
                raise Killed()
        return real_replace(src, dst)

    monkeypatch.setattr(tckpt.os, "replace", dying_replace)
    with pytest.raises(Killed):
        Trainer(make_gpt(), cfg_factory(max_steps=8, save_every=2, eval_every=2), toy_data,
                eval_fn=lambda m: {"loss": next(values)}).fit()
    monkeypatch.setattr(tckpt.os, "replace", real_replace)
    root = tmp_path / "run" / "checkpoints"
    Trainer(make_gpt(), cfg_factory(max_steps=8, save_every=2, resume=True), toy_data).fit()
    _, state = read_checkpoint(root / "best")  # a best survives (the old one: the new was never in place)
    assert state["step"] == 2
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]


def test_nonfinite_state_never_displaces_a_good_checkpoint(tmp_path, make_gpt, toy_data, cfg_factory):
    from qkv.train import Callback, NonFiniteError

    class PoisonAfterUpdate(Callback):  # as lr=inf would: update 5 leaves inf weights, the loss of 6 is NaN
        def on_step_end(self, trainer, step, record):
            if step == 5:
                with torch.no_grad():
                    trainer.model.get_submodule("decoder.blocks.0.ffn.up").weight.fill_(float("inf"))

    with pytest.raises(NonFiniteError) as info:
        Trainer(make_gpt(), cfg_factory(max_steps=8, save_every=2, keep_last=2, nan_policy="stop"), toy_data,
                callbacks=[PoisonAfterUpdate()]).fit()
    root = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in list_checkpoints(root)] == [2, 4]  # nothing pushed out, nothing written
    for _, p in list_checkpoints(root):
        weights, _ = read_checkpoint(p)
        assert all(torch.isfinite(v).all() for v in weights.values())
    assert info.value.checkpoint is None and "not saved" in str(info.value)


# -- best checkpoint by the task's own metric ---------------------------------------------
def _reverse_trainer(tmp_path, **train):
    from qkv.tasks import build_task
    from qkv.train import TrainConfig

    task = build_task("reverse", family="gpt", min_len=2, max_len=3)
    model = task.build_model("gpt-nano", d_model=16, n_heads=2, n_layers=1)
    cfg = TrainConfig(**{"max_steps": 4, "batch_size": 8, "eval_every": 2, "out_dir": str(tmp_path / "run"),
                         "progress": False, "tensorboard": False, "plot": False, **train})
    return Trainer(model, cfg, task, eval_fn=lambda m: task.evaluate(m, n=8))


def test_best_checkpoint_defaults_to_the_tasks_primary_metric(tmp_path):
    s = _reverse_trainer(tmp_path).fit()
    assert s["best_eval"]["metric"] == "exact_match"
    assert json.loads((tmp_path / "run" / "checkpoints" / "best" / "eval.json").read_text())["step"] in (2, 4)


def test_unknown_best_metric_is_an_error_at_the_first_evaluation(tmp_path):
    from qkv.config import ConfigError

    tr = _reverse_trainer(tmp_path, best_metric="bleu", best_mode="max")
    with pytest.raises(ConfigError, match="'bleu'.*exact_match"):
        tr.fit()
    assert tr.step == 2  # at the first evaluation, not silently at the end


def test_resuming_a_finished_run_logs_nothing_again(tmp_path, make_gpt, toy_data, cfg_factory):
    # the run ends with an evaluation at its last step, logged and checkpointed; restarting it with resume
    # (a kill after the last save, a user re-running the command) must not evaluate and log that step twice
    # 5 steps, evaluation every 2: the last evaluation is a record of its own after step 5's
    cfg = dict(max_steps=5, eval_every=2, max_eval_batches=1, out_dir=str(tmp_path / "r"))
    first = Trainer(make_gpt(), cfg_factory(**cfg), toy_data).fit()
    metrics = tmp_path / "r" / "metrics.jsonl"
    before = metrics.read_bytes()
    assert sum('"eval/' in line for line in before.decode().splitlines()) == 3  # steps 2, 4 and 5
    again = Trainer(make_gpt(seed=7), cfg_factory(**cfg, resume=True), toy_data).fit()
    assert metrics.read_bytes() == before
    assert (again["steps"] == 5 and again["eval"] == first["eval"]
            and again["final_loss"] == first["final_loss"])


def test_checkpoint_written_before_optimizer_impl_resumes_with_the_configured_one(tmp_path, make_gpt,
                                                                                  toy_data,
                                                                                   cfg_factory, monkeypatch):
    # before TrainConfig.optimizer_impl, build_optimizer left torch's defaults (foreach=None, fused=None: the
    # per-parameter loop on CPU) and checkpoints carry those settings in their param groups
    import qkv.train.trainer as trainer_mod
    from qkv.train import param_groups

    def old_build_optimizer(model, *, lr, betas, eps, weight_decay, impl="auto"):
        groups, summary = param_groups(model, weight_decay)
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps), summary

    n = 3
    with monkeypatch.context() as m:
        m.setattr(trainer_mod, "build_optimizer", old_build_optimizer)
        old = Trainer(make_gpt(), cfg_factory(max_steps=2 * n, out_dir=str(tmp_path / "b")), toy_data,
                      callbacks=[StopAt(n)])
        assert old.fit()["steps"] == n
    assert old.optimizer_impl == "loop"
    path = latest_checkpoint(tmp_path / "b" / "checkpoints")
    _, saved = read_checkpoint(path)
    assert all(g["fused"] is None and g["foreach"] is None for g in saved["optimizer"]["param_groups"])

    new = Trainer(make_gpt(seed=5), cfg_factory(max_steps=2 * n, out_dir=str(tmp_path / "b")), toy_data)
    new.load_checkpoint(path)
    # the state loads as saved (moments and step counts bit for bit); the groups run the configured kernel
    param = dict(new.model.named_parameters())
    assert len(saved["optimizer"]["state"]) == len(param)
    for key, st in saved["optimizer"]["state"].items():
        got = new.optimizer.state[param[key]]
        assert all(torch.equal(got[k], st[k]) for k in ("exp_avg", "exp_avg_sq", "step")), key
    assert (new.optimizer_impl == "fused"
            and all(g["fused"] and not g["foreach"] for g in new.optimizer.param_groups))
    new.resume = True
    assert new.fit()["steps"] == 2 * n

    # and the continuation equals an uninterrupted run with torch's loop to float rounding
    ref = Trainer(make_gpt(),
                  cfg_factory(max_steps=2 * n, out_dir=str(tmp_path / "ref"), optimizer_impl="loop"),
                  toy_data)
    ref.fit()
    for (name, p), q in zip(new.model.named_parameters(), ref.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
