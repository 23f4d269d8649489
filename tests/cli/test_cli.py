"""The command line: --help of every subcommand, every shipped config, one-line errors, a real run."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import _clirun as clirun
from qkv.cli.main import SUBCOMMANDS, build_parser, main
from qkv.run import build_parts, load_run_config
from qkv.tasks.images import FASHION_APT, FASHION_DIR

ROOT = Path(__file__).resolve().parents[2]
RUN_CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml"))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return clirun.run_cli(*args, cwd=ROOT)  # shipped configs named by their path in the repository


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_help_of_every_subcommand(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    assert SUBCOMMANDS[name].help in capsys.readouterr().out


def test_top_level_help_lists_subcommands():
    text = build_parser().format_help()
    for name in SUBCOMMANDS:
        assert name in text


def test_shipped_configs_exist():
    names = {p.stem for p in RUN_CONFIGS}
    assert {"reverse", "charlm"} <= names


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_run_config_validates(path, tmp_path):
    header = path.read_text(encoding="utf-8").splitlines()[:6]
    assert any("qkv train" in line for line in header), f"{path.name} must state its command in its header"
    cfg = load_run_config(str(path))
    fashion = (cfg["task"]["name"] in ("fashion_mnist", "vqa", "detection")
               or cfg["task"].get("dataset") == "fashion_mnist")
    if fashion and not Path(cfg["task"].get("path", FASHION_DIR)).is_dir():
        pytest.skip(f"Fashion-MNIST is not installed ({FASHION_APT})")
    if cfg["task"]["name"] == "speech":
        # building the speech task synthesises ~2,300 clips with espeak-ng (minutes): check the sections only
        from qkv.config import from_dict
        from qkv.models.registry import config_for
        from qkv.tasks import build_options
        from qkv.train import TrainConfig

        build_options("speech", {k: v for k, v in cfg["task"].items() if k != "name"})
        config_for(cfg["model"])
        from_dict(TrainConfig, cfg.get("train", {}))
        return
    task, model, train_cfg, ev, _ = build_parts(cfg, tmp_path)
    assert model.num_parameters() > 0 and train_cfg.max_steps > 0
    batch = task.batch(0, 2)
    out = model(**batch)
    assert out.loss is not None and bool(out.loss.isfinite())


@pytest.mark.parametrize("args, message", [
    (["train", "reverse", "--model", "transformer-tinyy"],
     "unknown preset 'transformer-tinyy'; did you mean 'transformer-tiny'?"),
    (["train", "reverse", "model.n_head=3"], "did you mean 'n_heads'"),
    (["train", "reverse", "train.lr=fast"], "expected a number"),
    (["train", "reverse", "task.name=revers"], "did you mean 'reverse'"),
    (["train", "reverse", "bogus.x=1"], "unknown section 'bogus'"),
    (["train", "missing.yaml"], "config file not found"),
    (["train", "charlm", "task.path=/nonexistent/file.txt"], "/nonexistent/file.txt"),
    (["eval", "/nonexistent/run"], "checkpoint not found"),
    (["info", "gpt5"], "unknown preset 'gpt5'"),
])
def test_user_errors_are_one_line(args, message):
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("qkv: error:")]
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_empty_text_file_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = run_cli("train", "charlm", f"task.path={empty}", "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "qkv: error:" in r.stderr


def test_checkpoint_of_another_architecture_is_rejected(tmp_path):
    from safetensors.torch import save_file

    import qkv

    bert = qkv.build("bert-tiny")
    folder = bert.save_pretrained(tmp_path / "ck")
    gpt = qkv.build("gpt-tiny")
    save_file({k: v.contiguous() for k, v in gpt.state_dict().items() if k != "lm_head.weight"},
              str(folder / "model.safetensors"))  # GPT weights under a BERT config
    r = run_cli("info", str(folder))
    assert r.returncode == 2 and "does not fit" in r.stderr and "Traceback" not in r.stderr


def test_train_eval_generate_resume_end_to_end(tmp_path):
    out = tmp_path / "rev"
    r = run_cli("train", "reverse", "--out", str(out), "--max-steps", "6", "--no-progress",
                "task.min_len=3", "task.max_len=5", "eval.n=8", "train.log_every=2")
    assert r.returncode == 0, r.stderr
    assert "held-out" in r.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [row["step"] for row in rows if "loss" in row]
    assert steps and all("loss" in row for row in rows if "loss" in row) and max(steps) == 6
    assert (out / "task.json").is_file() and (out / "results.json").is_file()

    r = run_cli("eval", str(out), "-n", "8")
    assert r.returncode == 0 and "exact_match" in r.stdout, r.stderr
    r = run_cli("generate", str(out), "--prompt", "123", "--greedy", "--max-new-tokens", "8")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    r = run_cli("info", str(out))
    assert r.returncode == 0 and "total" in r.stdout

    # a second train into the same folder must not silently overwrite it
    r = run_cli("train", "reverse", "--out", str(out), "--max-steps", "8", "--no-progress")
    assert r.returncode == 2 and "--resume" in r.stderr
    r = run_cli("train", "reverse", "--out", str(out), "--max-steps", "8", "--resume", "--no-progress",
                "eval.n=8")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert max(row["step"] for row in rows if "loss" in row) == 8


def test_presets_command_lists_every_preset():
    import qkv

    r = run_cli("presets")
    assert r.returncode == 0
    for name in qkv.presets():
        assert name in r.stdout


def test_attention_command_for_a_text_run_and_a_vit_run(tmp_path):
    rev = tmp_path / "rev"
    assert run_cli("train", "reverse", "--out", str(rev), "--max-steps", "2", "--no-progress",
                   "task.min_len=3", "task.max_len=5", "eval.n=4").returncode == 0
    r = run_cli("attention", str(rev), "--input", "123", "--out", str(tmp_path / "a.png"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "a_cross.png").read_bytes()[:4] == b"\x89PNG" and "entropy" in r.stdout

    vit = tmp_path / "vit"
    assert run_cli("train", "configs/vit_digits.yaml", "--out", str(vit), "--max-steps", "2", "--no-progress",
                   "eval.n=8", "eval.samples=0").returncode == 0
    r = run_cli("attention", str(vit), "--input", "3", "--out", str(tmp_path / "v.png"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "v.png").read_bytes()[:4] == b"\x89PNG"
    r = run_cli("attention", str(vit), "--input", "three", "--out", str(tmp_path / "v.png"))
    assert r.returncode == 2 and "number of held-out images" in r.stderr
