"""The smoke form of benchmarks/conv_layout.py: both layouts train the same weights to the same first loss
(the script refuses to time otherwise) and each gets a timed step."""

import json

import pytest


@pytest.mark.slow
def test_conv_layout_quick(tmp_path, run_benchmark):
    run_benchmark("conv_layout", "--quick", "--out", str(tmp_path))
    result = json.loads((tmp_path / "conv_layout_quick.json").read_text())
    first = result["first_loss"]
    assert first["NCHW"] == pytest.approx(first["channels_last"], rel=1e-2)
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in result["step_s"].values())
    assert "| channels_last |" in (tmp_path / "conv_layout_quick.md").read_text()
