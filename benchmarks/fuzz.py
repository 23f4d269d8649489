"""The parsers' fuzzing harness (tests/test_fuzz_parsers.py) with a longer example budget than CI's.

Each property -- the GGUF header reader, the image loader, the chat-record reader, the server's request
models, the run config reader -- runs `--examples` hypothesis examples (CI runs 40): every input must parse
or raise the project's own error type, each example within the test file's deadline. The tests run in a
pytest subprocess (QKV_FUZZ_EXAMPLES set); its JUnit report gives each property's outcome and time.

    .venv/bin/python benchmarks/fuzz.py --examples 2000

Writes benchmarks/results/fuzz.json and .md (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TESTS = ROOT / "tests" / "test_fuzz_parsers.py"


def run(examples: int, seed: int | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        env = {**os.environ, "QKV_FUZZ_EXAMPLES": str(examples), "PYTHONPATH": str(ROOT / "src")}
        cmd = [sys.executable, "-m", "pytest", str(TESTS), "-q", "-p", "no:cacheprovider", "-n", "0",
               f"--junitxml={report}", "-o", "timeout=0"]
        if seed is not None:  # hypothesis' own seed (else a new one each run)
            cmd += [f"--hypothesis-seed={seed}"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        wall = time.perf_counter() - t0
        cases = []
        for case in ET.parse(report).getroot().iter("testcase"):
            failed = case.find("failure") is not None or case.find("error") is not None
            cases.append({"property": case.get("name"), "seconds": round(float(case.get("time", 0)), 2),
                          "outcome": "failed" if failed else "skipped" if case.find("skipped") is not None
                          else "passed",
                          "failure": (case.find("failure") or case.find("error")).get("message", "")[:500]
                          if failed else None})
    return {"examples": examples, "seed": seed, "wall_s": round(wall, 1), "exit_code": proc.returncode,
            "cases": cases, "tail": proc.stdout[-2000:] if proc.returncode else ""}


def markdown(result: dict) -> str:
    rows = ["| property | outcome | seconds |", "|---|---|---|"]
    rows += [f"| `{c['property']}` | {c['outcome']} | {c['seconds']} |" for c in result["cases"]]
    bad = [c for c in result["cases"] if c["outcome"] == "failed"]
    head = (f"fuzz: {result['examples']} examples per property, {result['wall_s']} s in all, "
            f"{len(bad)} failed\n\n")
    return head + "\n".join(rows) + "\n" + "".join(f"\n- {c['property']}: {c['failure']}" for c in bad)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=2000, help="hypothesis examples per property")
    ap.add_argument("--seed", type=int, default=None, help="a hypothesis seed (default: a new one)")
    ap.add_argument("--out", default=str(HERE / "results"), help="folder for fuzz.json / .md")
    args = ap.parse_args()
    result = run(args.examples, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fuzz.json").write_text(json.dumps(result, indent=1))
    (out / "fuzz.md").write_text(markdown(result))
    print(markdown(result))
    sys.exit(1 if result["exit_code"] else 0)


if __name__ == "__main__":
    main()
