"""benchmarks/deberta.py --quick runs end to end and writes its JSON and markdown, with both models computing
the same function (a smoke test; the figures come from the full run, docs/pretrained.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


def test_quick_benchmark_writes_results(tmp_path, run_benchmark):
    run_benchmark("deberta", "--quick", "--repeats", "2", "--out", str(tmp_path), timeout=300,
                  env={"PYTHONPATH": str(ROOT / "src")})
    result = json.loads((tmp_path / "deberta_quick.json").read_text())
    assert [row["case"] for row in result["rows"]] == ["forward", "train step"]
    assert result["logit_max_abs_diff"] < 1e-4
    assert result["first_losses"]["qkv"] == pytest.approx(result["first_losses"]["HF"], rel=1e-5)
    assert "| forward |" in (tmp_path / "deberta_quick.md").read_text()
