"""`qkv finetune --out`: every recipe refuses, before anything is read, trained or written, an output folder
whose contents the run would destroy (the source model itself, a folder inside it, someone else's model or
files, another recipe's output, a run with checkpoints without --resume); nothing on disk changes."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from _encoders import conll_sentences, make_folder, sentiment_rows, write_conll, write_csv  # noqa: E402
from test_chat_recipe import chats, write_jsonl  # noqa: E402
from test_seq2seq_recipe import _t5_folder  # noqa: E402

from qkv.cli.main import main  # noqa: E402
from qkv.config import ConfigError  # noqa: E402
from qkv.finetune import check_out, mark_out  # noqa: E402


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` with the md5 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("bert") / "model", "bert")


def _data(tmp_path: Path, task: str) -> Path:
    if task == "classify":
        return write_csv(tmp_path / "d.csv", sentiment_rows(16, 0))
    if task == "tag":
        return write_conll(tmp_path / "d.conll", conll_sentences(8, 0))
    path = tmp_path / "d.tsv"
    path.write_text("a b\tb a\nc d e\te d c\n")
    return path


@pytest.mark.parametrize("task", ["classify", "tag", "seq2seq"])
def test_out_is_never_the_source_or_inside_it(task, bert, tmp_path, capsys):
    source = bert if task != "seq2seq" else _t5_folder(tmp_path / "t5")
    data = _data(tmp_path, task)
    before = snapshot(source)
    capsys.readouterr()
    for out, message in ((source, "already holds a model folder: the source model"),
                         (source / "tuned", "lies inside the source model folder")):
        rc = main(["finetune", str(source), "--task", task, "--data", str(data), "--out", str(out),
                   "--no-progress", "train.max_steps=1"])
        err = capsys.readouterr().err.strip()
        assert (rc == 2 and err.startswith("qkv: error: --out") and message in err
                and len(err.splitlines()) == 1), err
    assert snapshot(source) == before and not (source / "tuned").exists()


def test_another_model_or_files_or_recipe_are_refused(bert, tmp_path, capsys):
    data = _data(tmp_path, "classify")
    other = shutil.copytree(bert, tmp_path / "other")  # a model folder qkv finetune did not write
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    chat_out = tmp_path / "chat_out"
    chat_out.mkdir()
    (chat_out / "finetune.json").write_text(json.dumps({"recipe": "chat"}))
    (chat_out / "model.safetensors").write_bytes(b"weights")
    for out, message in ((other, "already holds a model folder that qkv finetune did not write"),
                         (notes, "already holds other files (todo.txt)"),
                         (chat_out, "already holds the output of qkv finetune --task chat")):
        before = snapshot(out)
        rc = main(["finetune", str(bert), "--task", "classify", "--data", str(data), "--out", str(out),
                   "--no-progress", "train.max_steps=1"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and message in err and len(err.splitlines()) == 1, err
        assert snapshot(out) == before


def test_own_output_rules(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    out = tmp_path / "out"
    check_out(out, source, "tag", resume=False)  # new
    out.mkdir()
    check_out(out, source, "tag", resume=False)  # empty
    mark_out(out, "tag")
    assert json.loads((out / "finetune.json").read_text()) == {"recipe": "tag"}
    check_out(out, source, "tag", resume=False)  # this recipe's, no checkpoint yet: a new run writes over it
    from qkv.train.checkpoint import STATE_NAME, WEIGHTS_NAME

    step = out / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / WEIGHTS_NAME).write_bytes(b"")
    (step / STATE_NAME).write_text("{}")
    with pytest.raises(ConfigError, match="already holds a fine-tuning run; pass --resume"):
        check_out(out, source, "tag", resume=False)
    check_out(out, source, "tag", resume=True)
    with pytest.raises(ConfigError, match="already holds the output of qkv finetune --task tag"):
        check_out(out, source, "classify", resume=True)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        check_out(tmp_path / "f", source, "tag", resume=False)


def test_chat_out_equal_to_a_tuned_source_is_refused(gpt2_chat, tmp_path, capsys):
    """A source that is an earlier qkv finetune output (finetune.json present, checkpoints removed): --out the
    same folder used to pass, overwrite model.safetensors, then crash copying the tokenizer onto itself."""
    data = write_jsonl(tmp_path / "d.jsonl", chats())
    tuned = tmp_path / "tuned"
    common = ["--data", str(data), "--no-progress", "train.max_steps=1", "train.batch_size=2",
              "train.plot=false", "train.tensorboard=false"]
    assert main(["finetune", str(gpt2_chat), "--out", str(tuned), *common]) == 0
    shutil.rmtree(tuned / "checkpoints")
    capsys.readouterr()
    before = snapshot(tuned)
    assert main(["finetune", str(tuned), "--out", str(tuned), *common]) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds a model folder: the source model" in err and len(err.splitlines()) == 1, err
    assert snapshot(tuned) == before


def test_save_model_folder_onto_its_source(gpt2_chat, tmp_path):
    """Saving into the source folder itself (an alias check_out cannot see) copies no file onto itself."""
    import qkv
    from qkv.finetune.chat import save_model_folder

    folder = shutil.copytree(gpt2_chat, tmp_path / "m")
    assert save_model_folder(qkv.from_pretrained(folder), folder, folder) == "hf:gpt2"
    assert (folder / "tokenizer.json").read_bytes() == (gpt2_chat / "tokenizer.json").read_bytes()


def test_runs_of_an_older_qkv_finetune_resume_and_dotfiles_do_not_count(tmp_path):
    # before finetune.json marked every recipe's folder, seq2seq never wrote one and classify/tag only at the
    # end:
    # such a run with a step checkpoint is continued with --resume (and still refused without it)
    from qkv.train.checkpoint import STATE_NAME, WEIGHTS_NAME

    source = tmp_path / "src"
    source.mkdir()
    old = tmp_path / "old"
    step = old / "checkpoints" / "step_00000010"
    step.mkdir(parents=True)
    (step / STATE_NAME).write_bytes(b"x")
    (step / WEIGHTS_NAME).write_bytes(b"x")
    (old / "config.json").write_text("{}")
    check_out(old, source, "seq2seq", resume=True)
    with pytest.raises(ConfigError, match="did not write"):
        check_out(old, source, "seq2seq", resume=False)
    dot = tmp_path / "dot"
    dot.mkdir()
    (dot / ".gitkeep").write_text("")
    check_out(dot, source, "classify", resume=False)
