"""`qkv finetune` dispatch: the recipe follows --task or the model's kind, and a mismatch is one clear
error."""

from __future__ import annotations

import pytest

import qkv.finetune as ft
from qkv.cli.main import main
from qkv.config import ConfigError
from qkv.finetune import registry
from qkv.finetune.recipe import FinetuneRecipe
from qkv.finetune.settings import FinetuneSettings


@pytest.fixture
def fake_recipes(monkeypatch):
    calls = []
    monkeypatch.setattr(registry, "RECIPES", {})
    monkeypatch.setattr(registry, "load_all", lambda: None)
    for name, kinds in (("chat", ("decoder",)), ("classify", ("encoder",))):
        settings = type(f"{name}Settings", (FinetuneSettings,), {})  # a settings class of its own

        class Fake(FinetuneRecipe):
            def run(self, note=None, n=name):
                calls.append(n)
                return ft.FinetuneResult({}, {}, [n])

        Fake.settings = settings
        registry.register_recipe(ft.Recipe(name, kinds, f"{name} recipe", Fake))
    return calls


def test_kind_picks_the_default_recipe(fake_recipes):
    assert ft.choose(None, "decoder").name == "chat"
    assert ft.choose(None, "encoder").name == "classify"
    assert ft.choose("classify", "encoder").name == "classify"


def test_mismatches_are_one_clear_error(fake_recipes):
    with pytest.raises(ConfigError, match="fine-tunes encoder models; this folder holds a decoder model"):
        ft.choose("classify", "decoder")
    with pytest.raises(ConfigError, match="did you mean 'chat'"):
        ft.choose("chta", "decoder")
    with pytest.raises(ConfigError, match="no fine-tuning recipe for a model of kind 'image'"):
        ft.choose(None, "image")


def test_cli_missing_files_exit_2(fake_recipes, tmp_path, capsys):
    assert main(["finetune", str(tmp_path / "nope"), "--data", "x.jsonl", "--out", str(tmp_path / "o")]) == 2
    assert "model folder not found" in capsys.readouterr().err
    assert main(["finetune", str(tmp_path), "--data", str(tmp_path / "x.jsonl"), "--out",
                 str(tmp_path / "o")]) == 2
    assert "data file not found" in capsys.readouterr().err


def test_cli_runs_the_recipe_of_the_model_kind(fake_recipes, tmp_path, monkeypatch, capsys):
    (tmp_path / "d.jsonl").write_text("{}\n")
    (tmp_path / "m").mkdir()
    monkeypatch.setattr(registry, "model_kind", lambda folder: "encoder")
    assert main(["finetune", str(tmp_path / "m"), "--data", str(tmp_path / "d.jsonl"), "--out",
                 str(tmp_path / "o")]) == 0
    assert fake_recipes == ["classify"] and capsys.readouterr().out.strip() == "classify"


def test_model_kind_reads_only_the_config(tmp_path):
    import json

    from qkv.storage import CheckpointError

    for model_type, kind in (("gpt2", "decoder"), ("bert", "encoder"), ("t5", "seq2seq")):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))  # no weights at all
        assert ft.model_kind(tmp_path) == kind
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(CheckpointError, match="'mamba' is not supported"):
        ft.model_kind(tmp_path)


def test_model_kind_of_a_qkv_folder(tmp_path):
    import qkv

    qkv.build("gpt-nano").save_pretrained(tmp_path)
    assert ft.model_kind(tmp_path) == "decoder"


@pytest.mark.parametrize("model_type, flags, message", [
    ("bert", ["--task", "classify", "--lora"],
     "--lora is not supported by --task classify (it is a --task chat flag)"),
    ("t5", ["--lora", "--lora-rank", "4"], "--lora is not supported by --task seq2seq"),
    ("gpt2", ["--batch-size", "4"],
     "--batch-size is not supported by --task chat (it is a --task seq2seq flag); "
     "set train.batch_size=... instead"),
    ("bert", ["--task", "tag", "--text-column", "t"], "--text-column is not supported by --task tag"),
    ("t5", ["--tag-column", "1"], "--tag-column is not supported by --task seq2seq"),
    ("gpt2", ["--lora-rank", "4"], "--lora-rank needs --lora"),
    ("gpt2", ["--lora-targets", "all-linear", "--lora-alpha", "8"], "--lora-alpha needs --lora"),
])
def test_flags_of_another_recipe_are_refused(tmp_path, capsys, model_type, flags, message):
    """A flag the chosen recipe does not read used to be ignored silently (--lora with --task classify trained
    every weight); LoRA settings without --lora likewise. Refused before the model is loaded."""
    import json

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))  # no weights: never loaded
    (tmp_path / "d.txt").write_text("x\n")
    rc = main(["finetune", str(folder), "--data", str(tmp_path / "d.txt"), "--out", str(tmp_path / "o"),
               *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("qkv: error: ") and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_recipe_flags_get_their_defaults_when_not_given(tmp_path):
    import argparse

    from qkv.cli.finetune import add_finetune, read_settings

    p = argparse.ArgumentParser()
    add_finetune(p)
    args = p.parse_args([str(tmp_path), "--data", "d", "--out", "o"])
    # what the user set: nothing
    assert args.lora is None and args.batch_size is None and args.text_column is None
    s = read_settings(args, ft.recipes()["seq2seq"])
    assert (s.batch_size, s.lr, s.num_beams, s.epochs, s.too_long) == (16, 3e-4, 1, 3.0, "error")
    s = read_settings(args, ft.recipes()["image-classify"])  # --lr and --batch-size: seq2seq's flags
    assert (s.batch_size, s.lr, s.augment) == (32, 1e-4, True)
    s = read_settings(args, ft.recipes()["classify"])
    assert (s.text_column, s.too_long, s.seed, s.progress) == ("text", "truncate", 0, True)


def test_a_recipes_settings_are_made_from_its_flags(tmp_path):
    """Every own field of every recipe's settings has a flag in its group (or, listed in `reads`, in another
    recipe's), and the flags given reach the settings."""
    import argparse
    from dataclasses import fields

    from qkv.cli.finetune import add_finetune, own_fields, read_settings, recipe_flags

    owners = recipe_flags()
    for r in ft.recipes().values():
        assert {f.name for f in fields(r.settings)} >= set(own_fields(r.settings))
        assert all(name in owners for name in own_fields(r.settings)), r.name
    p = argparse.ArgumentParser()
    add_finetune(p)
    args = p.parse_intermixed_args([str(tmp_path), "--data", "d", "--out", "o", "--task", "chat", "--lora",
                                    "--lora-rank", "4", "--export", "last", "--no-progress", "--epochs", "2",
                                    "--too-long", "skip", "train.lr=0.001"])
    s = read_settings(args, ft.recipes()["chat"])
    assert (s.lora, s.lora_config().rank, s.export, s.progress, s.epochs, s.too_long, s.train) == (
        True, 4, "last", False, 2.0, "skip", {"lr": 1e-3})


def test_the_docs_flags_tables_are_the_generated_ones():
    from pathlib import Path

    from qkv.cli.finetune import flags_tables

    docs = (Path(__file__).parents[2] / "docs" / "finetune.md").read_text(encoding="utf-8")
    assert flags_tables() in docs
