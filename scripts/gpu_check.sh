#!/usr/bin/env bash
# The GPU check of a lent CUDA machine (one H100 / H200), in one command and under 8 minutes:
#   1. the machine: nvidia-smi, torch, CUDA                                   -> $OUT/env.json
#   2. the CUDA-only tests (pytest -m cuda), at most TESTS_S seconds          -> $OUT/cuda_tests.xml, .log
#   3. benchmarks/gpu.py's short profile (peak, decode, sync: no training section), at most BENCH_S seconds
#                                                                             -> $OUT/gpu_peak_decode_sync.json, .md
#   4. a summary: each step's exit status and seconds, the test counts        -> $OUT/gpu_check.json
# Run from the project root with a python3 that holds torch (CUDA) and transformers; the project is read from
# ./src (no install). OUT defaults to ./gpu-check-out. Every step runs even when an earlier one failed; the
# exit status is the tests'.
#
#     OUT=/some/dir bash scripts/gpu_check.sh        # or: make gpu-check
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
PY=${PYTHON:-python3}
TESTS_S=${TESTS_S:-270}
BENCH_S=${BENCH_S:-150}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

"$PY" - "$OUT/env.json" <<'PYEOF'
import json, shutil, subprocess, sys
import torch
smi = "" if shutil.which("nvidia-smi") is None else subprocess.run(
    ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
    capture_output=True, text=True).stdout.strip()
json.dump({"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available(),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "nvidia_smi": smi, "python": sys.version.split()[0]},
          open(sys.argv[1], "w"), indent=2)
PYEOF

t0=$(date +%s)
timeout -k 10 "$TESTS_S" "$PY" -m pytest -m cuda -q -p no:cacheprovider -n 0 -o addopts="-ra" \
    --junitxml="$OUT/cuda_tests.xml" tests > "$OUT/cuda_tests.log" 2>&1
tests_rc=$?
t1=$(date +%s)
timeout -k 10 "$BENCH_S" "$PY" benchmarks/gpu.py peak decode sync --steps 5 --repeats 2 --out "$OUT" \
    > "$OUT/gpu_bench.log" 2>&1
bench_rc=$?
t2=$(date +%s)

"$PY" - "$OUT" "$tests_rc" "$bench_rc" "$((t1 - t0))" "$((t2 - t1))" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out, tests_rc, bench_rc, tests_s, bench_s = Path(sys.argv[1]), *map(int, sys.argv[2:])
counts, failed = {}, []
try:
    suite = ET.parse(out / "cuda_tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
except (OSError, ET.ParseError, AttributeError):
    pass
summary = {"tests": {"rc": tests_rc, "seconds": tests_s, "timed_out": tests_rc == 124, **counts,
                     "failed": failed},
           "benchmark": {"rc": bench_rc, "seconds": bench_s, "timed_out": bench_rc == 124,
                         "files": sorted(p.name for p in out.glob("gpu_*.json"))}}
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
PYEOF
exit "$tests_rc"
