"""`qkv train`: each flag is a shortcut for a key (--resume for train.resume, --max-steps for train.max_steps,
...), so the key works as the flag does: train.resume: true in the run YAML (or train.resume=true) continues
OUT, as --resume does (it was ignored, and the command said to pass --resume). Over the YAML the command
line wins; a flag and its own key=value both on the command line with different values are one error
(the flag used to win silently)."""

from __future__ import annotations

import json

import pytest
import yaml

from qkv.cli.main import main

TINY = ("task.min_len=3", "task.max_len=5", "eval.n=4", "eval.samples=0", "train.plot=false",
        "train.tensorboard=false", "train.log_every=1", "--no-progress")


def _yaml(tmp_path, **train):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"task": {"name": "reverse"}, "model": {"preset": "transformer-tiny"},
                                    "train": {"max_steps": 2, "save_every": 2, **train}}))
    return path


def _steps(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["step"] for row in rows if "loss" in row]


@pytest.mark.parametrize("where", ["yaml", "override"])
def test_train_resume_true_continues_like_the_flag(tmp_path, capsys, where):
    out = tmp_path / "o"
    config = _yaml(tmp_path, **({"resume": True} if where == "yaml" else {}))
    key = ["train.resume=true"] if where == "override" else []
    assert main(["train", str(config), "--out", str(out), *TINY, *key]) == 0  # no checkpoint yet: a new run
    capsys.readouterr()
    assert main(["train", str(config), "--out", str(out), "--max-steps", "4", *TINY, *key]) == 0, \
        capsys.readouterr().err
    assert "from step_00000002" in capsys.readouterr().err  # "resuming OUT from step_00000002: ..."
    assert _steps(out) == [1, 2, 3, 4]  # continued, not started over
    # run.yaml describes the run, not how it was started: a copy of it must not make another run continue this
    # one
    assert "resume" not in yaml.safe_load((out / "run.yaml").read_text())["train"]


def test_train_run_honours_train_resume_from_python(tmp_path):
    from qkv.run import load_run_config, train_run

    cfg = load_run_config(str(_yaml(tmp_path, resume=True)), [t for t in TINY if "=" in t])
    out = tmp_path / "o"
    train_run(cfg, out=out, quiet=True)
    cfg["train"]["max_steps"] = 3
    train_run(cfg, out=out, quiet=True)  # was: "already holds a trained run; pass --resume"
    assert max(_steps(out)) == 3


@pytest.mark.parametrize("argv, message", [
    (["--max-steps", "3", "train.max_steps=4"],
     "--max-steps 3 and train.max_steps=4 disagree; give one of them"),
    (["--resume", "train.resume=false"], "--resume and train.resume=false disagree"),
    (["--seed", "1", "task.seed=2"], "--seed 1 and task.seed=2 disagree"),
    (["--seed", "1", "train.seed=2"], "--seed 1 and train.seed=2 disagree"),
    (["--out", "OUT", "train.out_dir=elsewhere"], "and train.out_dir=elsewhere disagree"),
    (["--task", "reverse", "task.name=addition"], "--task reverse and task.name=addition disagree"),
    (["train.progress=true"], "--no-progress and train.progress=true disagree"),
    (["train.resume=maybe"], "train.resume must be true or false, got 'maybe'"),
])
def test_a_flag_and_its_key_that_disagree_are_one_error(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "o"
    argv = [str(out) if a == "OUT" else a for a in argv]
    rc = main(["train", str(_yaml(tmp_path)), *(["--out", str(out)] if "--out" not in argv else []), *TINY,
               *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("qkv: error: ") and message in err and len(err.splitlines()) == 1, err
    assert not out.exists() and not (tmp_path / "elsewhere").exists()


def test_the_same_value_both_ways_and_the_flag_over_the_yaml_are_fine(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["train", str(_yaml(tmp_path, max_steps=5)), "--out", str(out), "--max-steps", "1",
                 "train.max_steps=1", *TINY]) == 0, capsys.readouterr().err
    assert max(_steps(out)) == 1  # the command line over the YAML's 5
