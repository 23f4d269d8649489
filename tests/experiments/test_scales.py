"""Size profiles of ablation suites (`qkv ablate SUITE --scale gpu`): overrides applied like `quick:`, every
shipped gpu profile names only valid model fields, task options and Trainer settings."""

from __future__ import annotations

from importlib import resources

import pytest

from qkv.config import ConfigError, from_dict
from qkv.experiments.parts import run_config
from qkv.experiments.suite import expand, load_suite
from qkv.models.registry import config_for
from qkv.run import EvalSettings
from qkv.tasks.base import build_options
from qkv.train import TrainConfig

SUITE = {"name": "s", "model": {"preset": "gpt-nano", "n_layers": 2},
         "task": {"name": "reverse", "max_len": 6},
         "train": {"max_steps": 300}, "grid": {"model.placement": ["pre", "post"]}, "seeds": [0, 1],
         "quick": {"train.max_steps": 5},
         "scales": {"gpu": {"model.n_layers": 16, "train.max_steps": 2000, "seeds": [0, 1, 2],
                            "task": {"name": "charlm", "corpus": "stdlib"}}}}


def test_gpu_profile_overrides_values_sections_and_seeds():
    cpu, gpu = load_suite(SUITE), load_suite(SUITE, scale="gpu")
    assert (cpu.model["n_layers"], cpu.train["max_steps"], cpu.seeds) == (2, 300, [0, 1])
    assert (gpu.model["n_layers"], gpu.train["max_steps"], gpu.seeds) == (16, 2000, [0, 1, 2])
    assert gpu.task == {"name": "charlm", "corpus": "stdlib"}  # a plain key replaces the whole section
    assert len(expand(gpu)) == 2 * 3 and gpu.grid == cpu.grid


def test_profile_errors():
    with pytest.raises(ConfigError, match="has no 'gpu' profile"):
        load_suite({k: v for k, v in SUITE.items() if k != "scales"}, scale="gpu")
    with pytest.raises(ConfigError, match="exclude each other"):
        load_suite(SUITE, quick=True, scale="gpu")
    with pytest.raises(ConfigError, match="scale must be one of"):
        load_suite(SUITE, scale="tpu")
    with pytest.raises(ConfigError, match="did you mean"):
        load_suite({**SUITE, "scales": {"gpu": {"seedz": [0]}}}, scale="gpu")


def _shipped_with_gpu_profiles() -> list[str]:
    folder = resources.files("qkv") / "configs" / "ablations"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml")
                      and "scales:" in p.read_text())


def test_the_inconclusive_suites_have_a_gpu_profile():
    assert {"03_positions", "04_norm_placement", "08a_lstm_listops"} <= set(_shipped_with_gpu_profiles())


@pytest.mark.parametrize("name", _shipped_with_gpu_profiles())
def test_shipped_gpu_profiles_are_valid(name):
    """Every run of the profile: its model fields, task options and Trainer settings pass validation
    (nothing is built: these are the sizes of a GPU)."""
    suite = load_suite(name, scale="gpu")
    assert len(suite.seeds) >= 3
    for spec in expand(suite):
        cfg = run_config(suite, spec)
        model = dict(cfg["model"])
        config_for({k: model.pop(k) for k in ("preset", "family") if k in model}, **model)
        task = dict(cfg["task"])
        build_options(task.pop("name"), task)
        from_dict(TrainConfig, cfg["train"], "train")
        from_dict(EvalSettings, cfg["eval"], "eval")
