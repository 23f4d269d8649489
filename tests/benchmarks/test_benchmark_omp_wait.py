"""benchmarks/omp_wait.py --quick runs one child process per OpenMP wait policy and writes its results; the
policy reaches each child (ACTIVE's idle threads spin through the 2 s sleep, PASSIVE's sleep)."""

import json


def test_omp_wait_quick(tmp_path, run_benchmark):
    run_benchmark("omp_wait", "--quick", "--threads", "2", "--out", str(tmp_path), timeout=300)
    med = json.loads((tmp_path / "omp_wait_quick.json").read_text())["median"]
    assert set(med) == {"default", "PASSIVE", "ACTIVE"}
    assert all(v > 0 for p in med.values() for k, v in p.items() if k != "idle_cpu_s")
    assert med["ACTIVE"]["idle_cpu_s"] > 0.5 > 0.1 > med["PASSIVE"]["idle_cpu_s"]
    assert "| default |" in (tmp_path / "omp_wait_quick.md").read_text()
