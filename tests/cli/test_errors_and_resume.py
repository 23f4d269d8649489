"""What the command line does at its edges: flags out of range, what the
report claims, unknown prompt characters, resumes that must write nothing or keep the saved settings,
signals, divergence. Every failure is one line `qkv: error: ...` with a documented exit status."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _clirun import run_cli
from qkv.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "task.context=16", "train.batch_size=4",
        "train.lr=5e-3", "train.warmup=1", "eval.n=4", "eval.samples=0", "--no-progress"]


def one_error_line(r: subprocess.CompletedProcess, code: int = 2) -> str:
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("qkv: error:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "lm"
    r = run_cli("train", "charlm", "--out", str(out), "--max-steps", "2", *TINY)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def copy_run(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


# -- flags out of range, and a report of what was measured ------------------------------------------
def test_eval_needs_at_least_one_example(lm_run):
    assert "-n must be at least 1" in one_error_line(run_cli("eval", str(lm_run), "-n", "0"))


@pytest.mark.parametrize("flags, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--max-new-tokens", "-5"], "--max-new-tokens must be at least 1"),
    (["--num-beams", "0"], "--num-beams must be at least 1"),
    (["--stream", "--num-beams", "2"], "--stream"),
    (["--top-p", "0"], "--top-p"),
    (["--top-k", "-1"], "--top-k"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--presence-penalty", "3"], "--presence-penalty must be in [-2, 2]"),
    (["--frequency-penalty", "-2.5"], "--frequency-penalty must be in [-2, 2]"),
    (["--logit-bias", "x"], "--logit-bias takes ID=BIAS"),
    (["--logit-bias", "3=101"], "--logit-bias[3] must be a number in [-100, 100]"),
    (["--logit-bias", "100000=1"], "logit_bias 100000 is outside the model's vocabulary"),
])
def test_generate_flags_out_of_range(lm_run, flags, message):
    assert message in one_error_line(run_cli("generate", str(lm_run), "--prompt", "The ", *flags))


def test_temperature_zero_is_greedy_as_in_the_api_and_the_server(lm_run):
    base = ("generate", str(lm_run), "--prompt", "The ", "--max-new-tokens", "12")
    greedy = run_cli(*base, "--greedy")
    zero = run_cli(*base, "--temperature", "0", "--sample", "--seed", "5")
    assert greedy.returncode == 0 and zero.returncode == 0, zero.stderr
    assert zero.stdout == greedy.stdout


def test_max_new_tokens_is_obeyed(lm_run):
    r = run_cli("generate", str(lm_run), "--prompt", "The ", "--max-new-tokens", "3", "--greedy")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The ") and len(r.stdout.rstrip("\n")) <= len("The ") + 3


def test_report_states_what_was_measured(tmp_path):
    out = tmp_path / "lm"
    r = run_cli("train", "charlm", "--out", str(out), "--max-steps", "1", *TINY, "eval.n=100000")
    assert r.returncode == 0, r.stderr
    scored = int(json.loads((out / "results.json").read_text())["metrics"]["n_tokens"])
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("held-out"))
    assert "100000" not in line.replace(",", "") and f"{scored:,} scored tokens" in line, line


# -- prompt characters outside the vocabulary --------------------------------------------------------
def test_unknown_prompt_characters_are_named_or_refused(lm_run):
    r = run_cli("generate", str(lm_run), "--prompt", "ab\u20ac\u2603", "--max-new-tokens", "2", "--greedy")
    assert r.returncode == 0, r.stderr
    warning = [ln for ln in r.stderr.splitlines() if ln.startswith("qkv: warning:")]
    assert len(warning) == 1
    assert "'\u20ac'" in warning[0] and "'\u2603'" in warning[0] and "<unk>" in warning[0]
    r = run_cli("generate", str(lm_run), "--prompt", "ab\u20ac", "--strict")
    assert "'\u20ac'" in one_error_line(r)


# -- a resume validates before it writes, and continues the saved run -------------------------
def test_failed_resume_writes_nothing(lm_run, tmp_path):
    out = copy_run(lm_run, tmp_path)
    files = ["run.yaml", "task.json", "tokenizer.json", "metrics.jsonl"]
    before = {f: ((out / f).read_bytes(), (out / f).stat().st_mtime_ns) for f in files}
    r = run_cli("train", "--task", "reverse", "--out", str(out), "--resume", "--max-steps", "3",
                "--no-progress")
    assert "--resume continues it and cannot switch" in one_error_line(r)
    r = run_cli("train", "charlm", "--out", str(out), "--resume", "--max-steps", "3", "--no-progress",
                # same task, another shape: the checkpoint check fails, still before writing
                "model.d_model=64")
    assert "shape" in one_error_line(r)
    r = run_cli("train", "charlm", "--out", str(out), "--resume", "--max-steps", "3", "--no-progress",
                "model.ffn=relu", "model.scaled=false")  # the same shapes, another function: refused too
    assert "the model differs from the run's checkpoint (ffn gelu_tanh -> relu, scaled True -> False)" in \
        one_error_line(r)
    assert {f: ((out / f).read_bytes(), (out / f).stat().st_mtime_ns) for f in files} == before
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]


def test_a_resume_whose_train_state_is_a_pickle_writes_nothing(lm_run, tmp_path):
    """A train_state.pt holding a pickled object (an argparse.Namespace): one line, without torch's seven
    lines of colour-coded advice, and run.yaml keeps its max_steps (it was rewritten before the state was
    read)."""
    import argparse

    import torch

    out = copy_run(lm_run, tmp_path)
    state = out / "checkpoints" / "step_00000002" / "train_state.pt"
    torch.save({"step": 2, "args": argparse.Namespace(lr=1.0)}, state)
    before = (out / "run.yaml").read_bytes()
    r = run_cli("train", "charlm", "--out", str(out), "--resume", "--max-steps", "5", "--no-progress")
    line = one_error_line(r)
    assert f"{state}: refused: it holds pickled objects other than tensors (argparse.Namespace)" in line
    assert "\x1b" not in r.stderr and "weights_only" not in r.stderr
    assert (out / "run.yaml").read_bytes() == before


def test_train_run_checks_its_sections_as_the_command_line(tmp_path):
    """The Python API refuses what the CLI refuses: a misspelt section (it trained and ignored it) and a
    section that is not a mapping (an obscure ValueError), before anything is written."""
    from qkv.run import train_run

    tiny = {"task": {"name": "charlm", "context": 16}, "train": {"max_steps": 1, "progress": False}}
    with pytest.raises(ConfigError, match="unknown section 'modle' in run config; did you mean 'model'"):
        train_run({"modle": {"n_layers": 1}, "model": {"preset": "gpt-tiny"}, **tiny}, out=tmp_path / "a",
                  quiet=True)
    with pytest.raises(ConfigError, match="run config section 'model' must be a mapping, got 'gpt-tiny'"):
        train_run({"model": "gpt-tiny", **tiny}, out=tmp_path / "b", quiet=True)
    with pytest.raises(ConfigError, match="a run config must be a mapping of sections, got list"):
        train_run([("model", {})], out=tmp_path / "c", quiet=True)
    assert not any(tmp_path.iterdir())


def test_resume_applies_changed_adamw_settings(lm_run, tmp_path):
    """weight_decay / betas / eps named on a resume's command line are what the optimizer runs with (the saved
    optimizer state used to put the old ones back), and the note says they changed."""
    out = copy_run(lm_run, tmp_path)
    r = run_cli("train", "charlm", "--out", str(out), "--resume", "--max-steps", "3", "--no-progress",
                "train.weight_decay=0.0", "train.betas=[0.5,0.6]", "train.eps=1e-3")
    assert r.returncode == 0, r.stderr[-2000:]
    note = next(ln for ln in r.stderr.splitlines() if "changed settings" in ln)
    assert "weight_decay 0.1 -> 0.0" in note and "betas [0.9, 0.99] -> [0.5, 0.6]" in note and "eps" in note
    import torch

    groups = torch.load(out / "checkpoints" / "step_00000003" / "train_state.pt",
                        weights_only=True)["optimizer"][
        "param_groups"]
    assert {tuple(g["betas"]) for g in groups} == {(0.5, 0.6)} and {g["eps"] for g in groups} == {1e-3}
    assert {g["weight_decay"] for g in groups} == {0.0}


@pytest.mark.parametrize("flags, message", [
    (["model.vocab_size=5"], "model.vocab_size=5 is below what the task 'charlm' needs"),
    (["train.device=cuda:x"], "TrainConfig.device: 'cuda:x' is not auto, cpu, cuda or cuda:N"),
    # these trained, evaluated, then failed in the final sampling or evaluation, leaving no results.json
    (["model.context_length=8"], "model.context_length=8 is below what the task 'charlm' needs (16)"),
    (["task.sample_tokens=-3"], "task.sample_tokens must be at least 0, got -3"),
    (["task.top_k=-1"], "task.top_k must be at least 0 (0 = no top-k), got -1"),
    (["task.temperature=.nan"], "task.temperature must be a finite number at least 0"),
    (["task.temperature=-1"], "task.temperature must be at least 0"),
])
def test_settings_that_cannot_work_are_refused_before_writing(tmp_path, flags, message):
    out = tmp_path / "run"
    r = run_cli("train", "charlm", "--out", str(out), "--max-steps", "2", *TINY, *flags)
    assert message in one_error_line(r)
    assert not out.exists()


def test_info_depth_must_be_positive():
    assert "--depth must be at least 1" in one_error_line(run_cli("info", "gpt-nano", "--depth", "0"))


@pytest.mark.parametrize("target", ["./nope", "runs/nope", "~/nope"])
def test_info_on_a_missing_folder_says_so(target):
    # it was read as a preset name: "unknown preset './nope'; known presets: ..."
    assert one_error_line(run_cli("info", target)) == f"qkv: error: no such folder: {target}"


def test_resume_keeps_the_saved_settings(lm_run, tmp_path):
    import yaml

    out = copy_run(lm_run, tmp_path)
    # the README's resume line: the shipped YAML must not put lr, batch size, warmup or the model back
    r = run_cli("train", "charlm", "--out", str(out), "--resume", "--max-steps", "3", "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    saved = yaml.safe_load((out / "run.yaml").read_text())
    assert float(saved["train"]["lr"]) == 5e-3
    assert saved["train"]["batch_size"] == 4 and saved["train"]["warmup"] == 1
    assert saved["train"]["max_steps"] == 3 and saved["model"]["n_layers"] == 1
    note = [ln for ln in r.stderr.splitlines() if "changed settings" in ln]
    # named on the command line: the only change
    assert len(note) == 1 and "max_steps 2 -> 3;" in note[0], note
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows if "loss" in x] == [1, 2, 3]


# -- clear errors -----------------------------------------------------------------------------------
def test_out_pointing_at_a_file(tmp_path):
    f = tmp_path / "taken"
    f.write_text("x")
    assert "is a file" in one_error_line(run_cli("train", "charlm", "--out", str(f), "--max-steps", "1",
                                                 *TINY))


def test_infinite_lr_is_rejected_before_training(tmp_path):
    r = run_cli("train", "charlm", "--out", str(tmp_path / "x"), "--max-steps", "1", *TINY, "train.lr=inf")
    assert "lr must be a finite number" in one_error_line(r)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("policy", ["stop", "skip", "rollback"])
def test_divergence_ends_with_the_nan_guard_exit_status(tmp_path, policy):
    out = tmp_path / policy
    r = run_cli("train", "charlm", "--out", str(out), "--max-steps", "30", *TINY, "train.lr=1e30",
                f"train.nan_policy={policy}", "train.max_skips=2", "train.max_rollbacks=1",
                "train.log_every=1")
    line = one_error_line(r, code=3)
    assert "NaN guard" in line and "non-finite" in line and "train.log" in line
    assert "non-finite" in (out / "train.log").read_text()
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))  # one record per step, also after a rollback


# -- SIGINT / SIGTERM --------------------------------------------------------------------------------
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_saves_the_current_step_and_exits_with_one_line(tmp_path, sig, code):
    out = tmp_path / "lm"
    args = ["train", "charlm", "--out", str(out), "--max-steps", "100000", *TINY, "train.log_every=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "qkv.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"qkv: interrupted by {sig.name} at step ") and "--resume" in last, err[-2000:]
    step = int(last.split(" at step ")[1].split(";")[0])
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == [f"step_{step:08d}"]  # save_every is 500: only the signal made it
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert rows[-1]["step"] == step
    r = run_cli("train", "charlm", "--out", str(out), "--resume", "--max-steps", str(step + 2),
                "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if "loss" in json.loads(x)]
    assert [x["step"] for x in rows] == list(range(1, step + 3))


def test_a_closed_pipe_stops_quietly():
    """qkv presets | head -1 once the reader has gone: no BrokenPipeError traceback, the shell's 128 +
    SIGPIPE."""
    p = subprocess.Popen([sys.executable, "-m", "qkv.cli.main", "presets"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=ROOT)
    p.stdout.close()  # the reader goes away before qkv writes
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


# -- settings refused before anything is written, run folders usable from anywhere -------
def test_out_under_a_file(tmp_path):
    (tmp_path / "taken").write_text("x")
    r = run_cli("train", "charlm", "--out", str(tmp_path / "taken" / "run"), "--max-steps", "1", *TINY)
    assert f"{tmp_path / 'taken'} is a file, not a folder" in one_error_line(r)


@pytest.fixture(scope="module")
def book_run(tmp_path_factory):
    """A run trained on a user's text file given by a relative path (task.path=book.txt, cwd = its folder)."""
    folder = tmp_path_factory.mktemp("book")
    (folder / "book.txt").write_text("alpha beta gamma delta\n" * 200, encoding="utf-8")
    r = run_cli("train", "charlm", "--out", "run", "--max-steps", "2", "task.path=book.txt", *TINY,
                cwd=folder)
    assert r.returncode == 0, r.stderr[-2000:]
    return folder


def test_a_run_on_a_relative_text_path_evaluates_from_elsewhere(book_run):
    # task.json kept "book.txt" as typed: `qkv eval` from another folder could not find it
    r = run_cli("eval", str(book_run / "run"), "-n", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    book = str(book_run / "book.txt")
    assert json.loads((book_run / "run" / "task.json").read_text())["options"]["path"] == book
    import yaml

    assert yaml.safe_load((book_run / "run" / "run.yaml").read_text())["task"]["path"] == book


def test_a_resume_whose_text_is_gone_writes_nothing(book_run, tmp_path):
    out = copy_run(book_run / "run", tmp_path)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    r = run_cli("train", "--out", str(out), "--resume", "--max-steps", "4",
                f"task.path={tmp_path / 'gone.txt'}")
    assert "text file not found" in one_error_line(r)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # run.yaml etc. untouched


def test_a_changed_text_is_refused_rather_than_read_as_unk(book_run, tmp_path):
    out = copy_run(book_run / "run", tmp_path)
    changed = tmp_path / "book.txt"
    changed.write_text("alpha beta gamma delta\n" * 100 + "ZYXWV 0123456789 QRSTU\n" * 100, encoding="utf-8")
    options = json.loads((out / "task.json").read_text())
    options["options"]["path"] = str(changed)
    (out / "task.json").write_text(json.dumps(options))
    line = one_error_line(run_cli("eval", str(out), "-n", "2"))
    assert "character(s) the run's saved vocabulary does not have" in line and "'Z'" in line
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    r = run_cli("train", "--out", str(out), "--resume", "--max-steps", "4", f"task.path={changed}")
    assert "character(s)" in one_error_line(r)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    # needs only the vocabulary
    r = run_cli("generate", str(out), "--prompt", "alpha", "--max-new-tokens", "5")
    assert r.returncode == 0 and r.stdout.startswith("alpha"), r.stderr[-2000:]


def test_a_text_changed_within_the_same_characters_is_refused(book_run, tmp_path):
    # the same characters in another order: the vocabulary check cannot see it, the digest task.json records
    # does
    out = copy_run(book_run / "run", tmp_path)
    changed = tmp_path / "book.txt"
    changed.write_text("delta gamma beta alpha\n" * 200, encoding="utf-8")
    options = json.loads((out / "task.json").read_text())
    assert len(options["data_sha256"]) == 64
    options["options"]["path"] = str(changed)
    (out / "task.json").write_text(json.dumps(options))
    line = one_error_line(run_cli("eval", str(out), "-n", "2"))
    assert "the file changed since the run was trained" in line and str(changed) in line
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    r = run_cli("train", "--out", str(out), "--resume", "--max-steps", "4", f"task.path={changed}")
    assert "the file changed since the run was trained" in one_error_line(r)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    # needs only the vocabulary
    r = run_cli("generate", str(out), "--prompt", "alpha", "--max-new-tokens", "5")
    assert r.returncode == 0 and r.stdout.startswith("alpha"), r.stderr[-2000:]
    changed.write_text("alpha beta gamma delta\n" * 200, encoding="utf-8")  # the run's own text again
    assert run_cli("eval", str(out), "-n", "2").returncode == 0


def test_a_tsv_run_records_its_file_absolute_with_its_digest(tmp_path, monkeypatch):
    from qkv.tasks import build_task
    from qkv.tasks.base import task_from_dict

    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs.tsv").write_text("".join(f"w{i}\tv{i}\n" for i in range(20)), encoding="utf-8")
    task = build_task("tsv", path="pairs.tsv", max_len=8)
    saved = task.to_dict()
    assert saved["options"]["path"] == str(tmp_path / "pairs.tsv")
    monkeypatch.chdir("/")
    assert task_from_dict(saved, tokenizer=task.tokenizer).missing is None
    (tmp_path / "pairs.tsv").write_text("".join(f"w{i}\tv{19 - i}\n" for i in range(20)), encoding="utf-8")
    rebuilt = task_from_dict(saved, tokenizer=task.tokenizer)
    with pytest.raises(ConfigError, match="the file changed since the run was trained"):
        rebuilt.batch(0, 2)
    old = {k: v for k, v in saved.items() if k != "data_sha256"}  # a run saved before digests: not checked
    assert task_from_dict(old, tokenizer=task.tokenizer).missing is None


def test_a_text_path_with_a_tilde_and_a_bom(tmp_path, monkeypatch):
    from qkv.tasks.base import read_text_file

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "b.txt").write_bytes("\ufeffhello".encode())
    assert read_text_file("~/b.txt") == "hello"


@pytest.mark.parametrize("tokenizer_json, config_json, message", [
    ('{"qkv_tokenizer": "char", "specials": []}', None, "needs 'symbols'"),
    ("[1, 2]", None, "expected a JSON object, got list"),
    (None, "{bad", "tokenizer_config.json: not valid JSON"),
])
def test_a_damaged_tokenizer_file_names_itself(tmp_path, tokenizer_json, config_json, message):
    from qkv.tasks import load_tokenizer
    from qkv.tasks.tokenizers import CharTokenizer, TokenizerError

    CharTokenizer.from_text("abc").save(tmp_path)
    if tokenizer_json is not None:
        (tmp_path / "tokenizer.json").write_text(tokenizer_json)
    if config_json is not None:
        (tmp_path / "tokenizer_config.json").write_text(config_json)
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(tmp_path)


def test_a_task_name_given_as_a_config_names_the_flag(tmp_path):
    r = run_cli("train", "bpelm", "--out", str(tmp_path / "x"), "--max-steps", "1")
    assert "'bpelm' is a task: pass --task bpelm --model PRESET" in one_error_line(r)


def test_eval_prints_counts_as_integers(lm_run):
    r = run_cli("eval", str(lm_run), "-n", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    values = dict(line.split(": ", 1) for line in r.stdout.splitlines())
    assert values["n_tokens"].isdigit() and "." in values["val_loss"]


def test_help_does_not_import_torch_and_leaves_the_omp_wait_policy_alone(monkeypatch):
    """`qkv --help` answers without importing torch (it took seconds), and the CLI leaves OpenMP's wait
    policy as the user has it: libgomp's default spins briefly between ops and then sleeps, and forcing
    PASSIVE made every small op wake its threads (one-row products at half their speed)."""
    code = ("import os, sys; from qkv.cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))")
    for env, policy in (({}, "None"), ({"OMP_WAIT_POLICY": "PASSIVE"}, "PASSIVE")):
        base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                           env={**base, **env}, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[-1] == f"False {policy}"


def test_generate_says_loading_at_a_terminal_only(lm_run, capsys, monkeypatch):
    from qkv.cli.main import main

    args = ["generate", str(lm_run), "--prompt", "ab", "--max-new-tokens", "2", "--greedy"]
    assert main(args) == 0
    assert "loading" not in capsys.readouterr().err  # a script's stderr keeps only what went wrong
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(args) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"loading {lm_run}...") and "compile" not in err
    # --compile says what the first token waits for (the generation itself is not this test's)
    monkeypatch.setattr("qkv.run.generate_text", lambda *a, **k: "x")
    assert main([*args, "--compile"]) == 0
    assert "--compile: the first token waits for the decoding step to compile" in capsys.readouterr().err


def test_logit_bias_flag_forces_a_token(lm_run):
    """--logit-bias ID=100 makes that token the greedy choice at every step: the continuation is that
    token four times (the run's character tokenizer says which text it is)."""
    from qkv.run import load_run_task

    tok = load_run_task(lm_run).tokenizer
    for token in (20, 21):
        r = run_cli("generate", str(lm_run), "--prompt", "The ", "--max-new-tokens", "4", "--greedy",
                    "--logit-bias", f"{token}=100")
        assert r.returncode == 0, r.stderr
        assert r.stdout.rstrip("\n") == "The " + tok.decode([token] * 4), r.stdout
