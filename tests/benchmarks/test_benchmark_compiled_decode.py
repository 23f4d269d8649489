"""benchmarks/compiled_decode.py --quick runs eager beside qkv's compiled CPU step on a tiny Llama and writes
its results; the compiled step's logits after the timed steps equal eager's to fp32 rounding."""

import json

import pytest


@pytest.mark.slow
def test_compiled_decode_quick(tmp_path, run_benchmark):
    pytest.importorskip("transformers")
    run_benchmark("compiled_decode", "--quick", "--variants", "qkv default", "--threads", "1", "--out",
                  str(tmp_path), timeout=900)
    rows = json.loads((tmp_path / "compiled_decode_quick.json").read_text())["rows"]
    assert set(rows) == {"eager", "qkv default"}
    assert rows["qkv default"]["rel_diff"] < 1e-5
    assert all(r["ms_per_token"] > 0 for r in rows.values())
