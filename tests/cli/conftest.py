"""Fixtures shared by the command-line tests."""

from __future__ import annotations

import pytest

from qkv.tasks import build_task


@pytest.fixture
def tiny_lm_run(tmp_path):
    """(folder, task, model): a run folder with a tiny untrained character LM (task.json + tokenizer +
    model)."""
    folder = tmp_path / "lm_run"
    task = build_task("charlm", family="gpt", context=16)
    model = task.build_model("gpt-nano", d_model=24, n_heads=2, position="rope")
    task.save(folder)
    model.save_pretrained(folder)
    return folder, task, model
