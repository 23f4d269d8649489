"""benchmarks/finetune.py --quick runs and writes its JSON and markdown (a smoke test: no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_benchmark_writes_its_tables(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "finetune.py"), "--quick", "--threads", "1",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "finetune.json").read_text())
    rows = {row["mode"]: row for row in data["rows"]}
    assert set(rows) == {"full", "lora q,v r8", "lora all-linear r8"}
    # the trainable counts are the model's and the LoRA formula's: 2 layers, d 64, q and v (GQA: v is 32 wide)
    assert rows["lora q,v r8"]["trainable"] == 2 * 8 * ((64 + 64) + (64 + 32))
    assert rows["full"]["trainable"] == rows["full"]["total"]
    assert all(row["median_step_s"] > 0 for row in rows.values())
    assert "| lora q,v r8 |" in (tmp_path / "finetune.md").read_text()
