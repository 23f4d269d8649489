"""`qkv export`'s refusals of an OUT it must not write (what it reads, a symlink, the working folder), of
--dtype for an image classifier, and of a Hugging Face folder it has no exporter for: each one line, exit
status 2, and nothing the user had is touched."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import qkv
from qkv.cli.main import EXIT_USER_ERROR, main
from qkv.config import ConfigError
from qkv.export import choose_model_type

TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "task.context=16", "train.batch_size=4",
        "train.warmup=1", "eval.n=4", "eval.samples=0", "--no-progress"]


def one_line_error(capsys, *args: object) -> str:
    code = main(["export", *map(str, args)])
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qkv: error: "), err
    return lines[0]


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export-paths") / "run"
    assert main(["train", "charlm", "--out", str(out), "--max-steps", "2", *TINY]) == 0
    return out


def test_force_never_replaces_the_folder_read(run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    before = tree(copy)
    step = next((copy / "checkpoints").glob("step_*"))
    # the model is read from run/checkpoints/step_N: neither its folder nor one holding it may become OUT
    cases = [(copy, copy / "checkpoints"), (copy, step), (step, copy), (step, copy / "checkpoints")]
    for source, out in cases:
        assert "must be a new folder" in one_line_error(capsys, source, out, "--force")
    assert tree(copy) == before


def test_symlink_out_is_refused_and_its_target_kept(tmp_path, capsys):
    qkv.build("gpt-nano").save_pretrained(tmp_path / "src")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / "mine", target_is_directory=True)
    assert "symbolic link" in one_line_error(capsys, tmp_path / "src", tmp_path / "link", "--force")
    assert (tmp_path / "mine" / "keep.txt").read_text() == "mine" and (tmp_path / "link").is_symlink()


def test_working_folder_as_out_is_refused(tmp_path, capsys, monkeypatch):
    qkv.build("gpt-nano").save_pretrained(tmp_path / "src")
    (tmp_path / "work" / "here").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work" / "here")
    assert "working folder" in one_line_error(capsys, tmp_path / "src", ".")
    assert "working folder" in one_line_error(capsys, tmp_path / "src", "..", "--force")  # holds it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "work"]
    assert [p.name for p in (tmp_path / "work").iterdir()] == ["here"] and not any(Path.cwd().iterdir())


def test_dtype_is_refused_for_an_image_classifier(tmp_path, capsys):
    qkv.build("vit-digits", n_layers=1, pooling="cls").save_pretrained(tmp_path / "src")
    assert "float32" in one_line_error(capsys, tmp_path / "src", tmp_path / "out", "--dtype", "bfloat16")
    assert not (tmp_path / "out").exists()


def test_folder_without_an_exporter_names_its_type_not_a_flag():
    model = qkv.build("gpt-nano")
    with pytest.raises(ConfigError) as e:
        choose_model_type(model, {"model_type": "deepseek_v2"}, None)
    assert "a Hugging Face deepseek_v2 folder has no exporter; pass --model-type, one of" in str(e.value)
    assert "llama" in str(e.value) and "--model-type 'deepseek_v2'" not in str(e.value)
    with pytest.raises(ConfigError, match="--model-type 'whisper'"):  # a flag the user gave is named as given
        choose_model_type(model, {"model_type": "deepseek_v2"}, "whisper")
    with pytest.raises(ConfigError, match="a GPT cannot be written as 't5'"):  # another family's format
        choose_model_type(model, {"model_type": "deepseek_v2"}, "t5")


def test_model_type_help_lists_every_encoder(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for model_type in ("bert", "roberta", "xlm-roberta", "distilbert", "deberta-v2"):
        assert model_type in shown


def test_out_under_a_file_is_one_line(tmp_path, capsys):
    # mkdir's OSError (here: a parent that is a file; as well no permission, a read-only disk) names the path
    qkv.build("gpt-nano").save_pretrained(tmp_path / "src")
    (tmp_path / "notes").write_text("mine")
    assert "cannot create" in one_line_error(capsys, tmp_path / "src", tmp_path / "notes" / "out")
    assert (tmp_path / "notes").read_text() == "mine"
