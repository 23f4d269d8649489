"""`qkv generate --generation-config FILE`: a GenerationConfig from YAML or JSON (Hugging Face's
generation_config.json too), overridden by the flags; a bad file is one clear line and exit 2."""

from __future__ import annotations

import json

import pytest

from qkv.cli.main import main


@pytest.fixture
def lm_run(tiny_lm_run):
    return tiny_lm_run[0]


def test_generation_config_file_and_flags(lm_run, tmp_path, capsys):
    """The CLI prints what the library returns for the same settings (a random model may emit special
    tokens that print as nothing, so lengths are compared through the library, not counted)."""
    from qkv.generate import GenerationConfig
    from qkv.run import generate_text

    (tmp_path / "g.yaml").write_text("max_new_tokens: 7\ndo_sample: false\nrepetition_penalty: 1.3\n")
    cfg = GenerationConfig.from_file(tmp_path / "g.yaml")
    assert cfg == GenerationConfig(max_new_tokens=7, do_sample=False, repetition_penalty=1.3)
    assert main(["generate", str(lm_run), "--prompt", "def ", "--generation-config",
                 str(tmp_path / "g.yaml")]) == 0
    seven = capsys.readouterr().out.rstrip("\n")
    assert seven == generate_text(lm_run, "def ", cfg) and seven.startswith("def ")
    # a flag overrides the file
    assert main(["generate", str(lm_run), "--prompt", "def ", "--generation-config", str(tmp_path / "g.yaml"),
                 "--max-new-tokens", "30"]) == 0
    thirty = capsys.readouterr().out.rstrip("\n")
    assert thirty == generate_text(lm_run, "def ",
                                   cfg.replace(max_new_tokens=30)) and len(thirty) > len(seven)
    # Hugging Face's own file layout
    hf = tmp_path / "generation_config.json"
    hf.write_text(json.dumps({"max_new_tokens": 5, "do_sample": False, "transformers_version": "5.0",
                              "_from_model_config": True}))
    assert main(["generate", str(lm_run), "--prompt", "x", "--generation-config", str(hf)]) == 0
    greedy = capsys.readouterr().out.rstrip("\n")
    assert greedy == generate_text(lm_run, "x", GenerationConfig(max_new_tokens=5), greedy=True)
    # a config decides: greedy
    assert greedy == generate_text(lm_run, "x", GenerationConfig(max_new_tokens=5))


def test_bad_generation_settings_are_one_line_errors(lm_run, tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("max_new_tokns: 7\n")
    assert main(["generate", str(lm_run), "--prompt", "a", "--generation-config",
                 str(tmp_path / "bad.yaml")]) == 2
    assert "did you mean 'max_new_tokens'" in capsys.readouterr().err
    assert main(["generate", str(lm_run), "--prompt", "a", "--max-new-tokens", "-5"]) == 2
    assert "--max-new-tokens must be at least 1, got -5" in capsys.readouterr().err
    assert main(["generate", str(lm_run), "--prompt", "a", "--generation-config",
                 str(tmp_path / "none.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
