"""`qkv serve`'s settings are declared once: ServeConfig (the server) and EngineConfig (the engine) hold each
one's default, bounds and help; the flags are generated from them, serve() and Engine() build them, and a bad
value is one error line naming the flag (exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

import qkv.serve
from qkv.cli.flags import option
from qkv.cli.main import build_parser, main
from qkv.config import ConfigError, bounds_text
from qkv.generate import Engine
from qkv.generate.engine_config import EngineConfig
from qkv.serve import ServeConfig, build_engine, load_served
from qkv.serve.config import QUANTIZE_MODES

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = (ServeConfig, EngineConfig)


def _serve_actions() -> dict[str, object]:
    parser = build_parser(["serve"])
    sub = parser._subparsers._group_actions[0].choices["serve"]
    return {a.dest: a for a in sub._actions}


def _flag_fields():
    return [(cls, f) for cls in CONFIGS for f in fields(cls) if f.metadata["flag"]]


@pytest.fixture
def no_serve(monkeypatch):
    """serve() replaced by a recorder: what the CLI passes, with nothing loaded or bound."""
    seen = {}
    monkeypatch.setattr(qkv.serve, "serve", lambda model, **kw: seen.update(kw) or 0)
    return seen


def test_every_setting_has_its_flag_typed_bounded_and_helped_from_the_dataclass():
    actions = _serve_actions()
    flagged = {f.name for _, f in _flag_fields()}
    # split_cost alone is library-only (an int, None or "auto"); everything else is a flag
    assert flagged == {f.name for cls in CONFIGS for f in fields(cls)} - {"split_cost"}
    for cls, f in _flag_fields():
        a = actions[f.name]
        assert a.option_strings[0] == option(f.name) and a.default is None  # None: the dataclass decides
        help_text = " ".join(a.help.split())
        assert " ".join(f.metadata["help"].split()) in help_text, f.name
        default = getattr(cls(), f.name)
        assert f"(default: {default if default is not None else f.metadata['none']})" in help_text
        if f.metadata["choices"]:
            assert tuple(a.choices) == f.metadata["choices"]
        elif f.type in ("int", "int | None", "float"):
            assert bounds_text(f.metadata) in help_text, f.name


def _bad_values(f) -> list[object]:
    """Just outside each bound (past the flag's stand-in for None: --prefill-chunk 0 is whole prompts)."""
    ge, le = f.metadata["ge"], f.metadata["le"]
    step = 1 if "int" in f.type else 0.5
    low = ge - step if ge - step != f.metadata["flag_none"] else ge - 2 * step
    return [low] + ([le + step] if le is not None else [])


@pytest.mark.parametrize("cls,f", [(c, f) for c, f in _flag_fields() if f.metadata["ge"] is not None],
                         ids=lambda x: getattr(x, "name", ""))
def test_a_value_out_of_bounds_is_one_line_naming_the_flag_and_the_bound_itself_passes(cls, f, no_serve,
                                                                                       capsys, tmp_path):
    for bad in _bad_values(f):
        assert main(["serve", str(tmp_path), option(f.name), str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"qkv: error: {option(f.name)} must be {bounds_text(f.metadata)}")
        assert err.count("\n") == 1 and not no_serve, err
        with pytest.raises(ConfigError, match=f"^{f.name} must be "):
            cls(**{f.name: type(getattr(cls(), f.name) or 1)(bad)})
    for edge in (f.metadata["ge"], f.metadata["le"]):
        if edge is not None and edge != f.metadata.get("flag_none"):
            assert main(["serve", str(tmp_path), option(f.name), str(edge)]) == 0
            assert no_serve.pop(f.name) == edge


def test_flags_reach_serve_by_name_and_prefill_chunk_0_is_whole_prompts(no_serve, tmp_path):
    assert main(["serve", str(tmp_path)]) == 0 and no_serve == {}  # defaults: the dataclasses'
    assert main(["serve", str(tmp_path), "--no-prefix-caching", "--prefill-chunk", "0", "--max-batch-size",
                 "3", "--preemption", "newest", "--port", "0", "--name", "m", "--max-tokens-cap", "7"]) == 0
    assert no_serve == {"prefix_caching": False, "prefill_chunk": None, "max_batch_size": 3,
                        "preemption": "newest", "port": 0, "name": "m", "max_tokens_cap": 7}


def test_the_defaults_are_the_ones_serve_and_the_engine_always_had(run_folder):
    assert EngineConfig() == EngineConfig(block_size=16, num_blocks=None, max_batch_size=32,
                                          prefill_chunk=1024, prefix_caching=True, preemption="least_work",
                                          split_cost="auto", max_model_len=None)
    assert ServeConfig() == ServeConfig(host="127.0.0.1", port=8000, name=None, max_waiting=64,
                                        shutdown_timeout=30.0, max_tokens_cap=1024, quantize=None)
    served = load_served(run_folder)
    for engine in (Engine(served.model), build_engine(served)):
        assert engine.config == EngineConfig()
        assert (engine.max_batch_size, engine.prefill_chunk, engine.prefix_caching, engine.preemption) == (
            32, 1024, True, "least_work")


def test_engine_keywords_build_the_same_config_and_override_a_given_one(run_folder):
    model = load_served(run_folder).model
    keywords = dict(block_size=4, num_blocks=9, max_batch_size=3, prefill_chunk=None, prefix_caching=False,
                    preemption="newest", split_cost=None, max_model_len=32)
    by_keyword = Engine(model, max_new_tokens=5, **keywords)
    by_config = Engine(model, config=EngineConfig(**keywords), max_new_tokens=5)
    assert by_keyword.config == by_config.config == EngineConfig(**keywords)
    assert by_keyword.cfg.max_new_tokens == 5  # the other keywords stay generation settings
    for e in (by_keyword, by_config):
        got = (e.max_batch_size, e.prefill_chunk, e.prefix_caching, e.preemption, e.split_cost, e.context)
        assert got == (3, None, False, "newest", None, 32)
    over = Engine(model, config=EngineConfig(block_size=4, max_batch_size=3), max_batch_size=2)
    assert over.config == EngineConfig(block_size=4, max_batch_size=2)
    with pytest.raises(ValueError, match="block_size must be at least 1, got 0"):
        Engine(model, config=EngineConfig(block_size=4), block_size=0)
    with pytest.raises(TypeError, match="EngineConfig"):
        Engine(model, config={"block_size": 4})


BAD_SERVE_OPTIONS = [
    (dict(port=70000), r"port must be in \[0, 65535\], got 70000"),
    (dict(shutdown_timeout=-1.0), "shutdown_timeout must be at least 0 seconds"),
    (dict(block_size=0), "block_size must be at least 1"),
    (dict(quantize="int3"), "quantize must be one of"),
    (dict(max_batch=4), "unknown serve option 'max_batch'; did you mean 'max_batch_size'"),
]


def test_serve_checks_every_setting_before_binding_or_loading(run_folder, monkeypatch):
    monkeypatch.setattr(qkv.serve.server, "load_served", lambda *a, **k: pytest.fail("loaded"))
    monkeypatch.setattr(qkv.serve.server, "_bind", lambda *a, **k: pytest.fail("bound"))
    for kw, message in BAD_SERVE_OPTIONS:
        with pytest.raises(ConfigError, match=message):
            qkv.serve.serve(run_folder, **kw)
    # build_engine takes the engine's settings only, refused before the served model is looked at
    with pytest.raises(ConfigError, match="unknown serve option 'port'"):
        build_engine(None, port=1)


def test_quantize_flag_lists_the_library_modes():
    from qkv.nn.quant import MODES

    assert QUANTIZE_MODES == MODES


def test_serve_help_imports_no_torch():
    """The flags come from the settings modules, loaded without their packages' __init__ (which import torch
    and FastAPI): `qkv serve --help` answers at once."""
    code = ("import sys; from qkv.cli.main import main\n"
            "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'fastapi' in sys.modules)\n"
            # the packages, imported afterwards, load their settings modules as usual
            "import qkv.serve; print(qkv.serve.config.ServeConfig is qkv.serve.ServeConfig,"
            " qkv.generate.engine_config.EngineConfig is qkv.serve.EngineConfig)")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--block-size" in r.stdout and r.stdout.splitlines()[-2:] == ["False False", "True True"]


def test_the_docs_flags_table_is_the_generated_one():
    from qkv.cli.flags import flags_table

    docs = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    assert flags_table(ServeConfig, EngineConfig) in docs
