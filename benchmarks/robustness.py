"""Kill -9 a training run at random moments, resume it each time, and check that nothing is lost.

One `qkv train` run (a char-LM GPT, checkpoints every 2 steps, keep_last 2, a best/ checkpoint by held-out
loss every 5 steps, one metrics record per step) is started with `--resume` again and again; each time,
once it is training, it gets SIGKILL after a random delay (uniform in [0, --window] seconds, seeded); every
second kill is instead timed to a checkpoint save (within 1 s after its temporary folder appears), because
saves, renames and prunes are where data is at risk and a uniform delay rarely lands in them.
At every kill the folder is inspected as the next process will find it, and after every restart its log
is read back. Checked (each a counted failure, and the script exits 1 if any occurs):

  resume      the restarted process resumes from the newest complete step checkpoint present at the kill
  leaks       no step_* folder is ever incomplete, never more than keep_last + 1 step folders exist (one
              save ahead of its prune), and after each restart no hidden leftover (.tmp/.old-/.del-) remains
  best        once best/ existed it survives every kill (or its renamed-aside copy does, and the restart
              puts it back); after every restart best/ loads
  metrics     metrics.jsonl always parses (a line cut by the kill excepted) with steps in order
  exact       after the last kill the run is let finish: its losses, evaluations and final weights are
              bit-identical to an uninterrupted run of the same command
Also counted: where the kills landed (mid-save, mid-replace, mid-prune, mid-write of metrics).

    .venv/bin/python benchmarks/robustness.py                    # 25 kills, ~11M-parameter model
                                                                 # (~130 MB checkpoints)
    .venv/bin/python benchmarks/robustness.py --kills 3 --quick  # the CI form (tests/test_robustness.py)

Writes benchmarks/results/robustness.json and .md (or --out). Needs no network and no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TIMING = ("tokens_per_s", "step_time_s")  # wall-clock fields, the only ones allowed to differ


def train_args(out: Path, quick: bool, max_steps: int) -> list[str]:
    model = (["model.n_layers=1", "model.d_model=64", "model.n_heads=2", "task.context=32",
              "train.batch_size=4"]
             if quick else
             ["model.n_layers=6", "model.d_model=384", "model.n_heads=6", "task.context=64",
              "train.batch_size=8"])
    return [sys.executable, "-m", "qkv.cli.main", "train", "charlm", "--out", str(out), "--resume",
            "--max-steps", str(max_steps), "--no-progress", *model, "model.dropout=0.1",
            "train.save_every=2", "train.keep_last=2", "train.eval_every=5", "train.log_every=1",
            "train.warmup=10", "train.tensorboard=false", "train.plot=false",
            "eval.during_training=8", "eval.n=8", "eval.samples=0"]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}


def records(path: Path) -> tuple[list[dict], bool]:
    """(complete records, whether the last line was cut) of a JSONL file."""
    if not path.is_file():
        return [], False
    data = path.read_bytes()
    cut = bool(data) and not data.endswith(b"\n")
    lines = data.split(b"\n")
    rows = [json.loads(x) for x in (lines[:-1] if cut else lines) if x.strip()]
    return rows, cut


def step_folders(root: Path) -> list[tuple[int, bool]]:
    """(step, complete) of every step_* folder under checkpoints/."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith("step_") and p.is_dir():
                complete = (p / "model.safetensors").is_file() and (p / "train_state.pt").is_file()
                out.append((int(p.name[5:]), complete))
    return sorted(out)


def hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".")) if root.is_dir() else []


def wait_training(proc: subprocess.Popen, log: Path, timeout: float = 300.0) -> bool:
    """True once the process has logged that it is training (or resumed); False if it exited first."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            return False
        if log.is_file():
            text = log.read_text(errors="replace")
            if "param groups:" in text:
                return True
        time.sleep(0.05)
    raise TimeoutError("the training process did not start within the timeout")


def wait_for_save(proc: subprocess.Popen, root: Path, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout and proc.poll() is None:
        try:
            if any(e.name.startswith(".") and e.name.endswith(".tmp") for e in os.scandir(root)):
                return
        except FileNotFoundError:
            pass
        time.sleep(0.002)


def run_reference(out: Path, quick: bool, max_steps: int) -> None:
    r = subprocess.run(train_args(out, quick, max_steps), env=env(), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"reference run failed:\n{r.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=25)
    ap.add_argument("--window", type=float, default=None, help="max seconds between training start and kill")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="a tiny model (the CI form)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--untargeted", action="store_true",
                    help="every kill at a uniform random delay (default: every second kill is timed to a "
                         "save)")
    ap.add_argument("--out", default=str(HERE / "results"), help="folder for robustness.json / .md")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one, removed)")
    a = ap.parse_args(argv)
    window = a.window or (1.0 if a.quick else 4.0)
    # enough steps that the run outlives every kill: a kill lets up to 1 s (quick; --window) of training
    # through, and the quick model's step takes ~7 ms on the 2-core AVX2 CPU with the fused AdamW (360 steps
    # in 6.9 s, 84 in 4.9 s, start-up included): at most ~140 steps a kill, so 200 a kill. A run that finishes
    # before its kill ends the loop early, with fewer kills than asked (the CI test counts them).
    max_steps = a.max_steps or (60 + 200 * a.kills if a.quick else 60 + 12 * a.kills)
    rng = random.Random(a.seed)
    import tempfile

    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="qkv-robustness-"))
    run, ref = work / "run", work / "reference"
    for p in (run, ref):
        shutil.rmtree(p, ignore_errors=True)
    t_all = time.perf_counter()
    run_reference(ref, a.quick, max_steps)
    t_ref = time.perf_counter() - t_all
    # 2 steps + best
    ckpt_bytes = sum(f.stat().st_size for f in (ref / "checkpoints").rglob("*") if f.is_file()) // 3

    failures: list[str] = []
    landed = {"mid-save (.tmp)": 0, "mid-replace (.old-)": 0, "mid-prune (.del-)": 0, "metrics line cut": 0,
              "between saves": 0}
    resumed_ok = 0
    expected_resume: int | None = None
    best_seen = False
    kills = 0
    segment = 0
    prev_leftovers: list[str] = []
    while kills < a.kills:
        segment += 1
        log = work / f"segment{segment}.log"
        with open(log, "w") as errf:
            proc = subprocess.Popen(train_args(run, a.quick, max_steps), env=env(), stdout=subprocess.DEVNULL,
                                    stderr=errf)
            started = wait_training(proc, log)
            # the start-up repair ran before training began: what the last kill left must be gone
            stale = sorted(set(prev_leftovers) & set(hidden(run / "checkpoints")))
            if stale:
                failures.append(f"segment {segment}: leftovers of the last kill not cleaned: {stale}")
            if started:
                if kills % 2 and not a.untargeted:
                    # a targeted kill: wait for a save to begin (its hidden temporary folder appears), then
                    # kill within the next second -- mid-write, mid-rename or mid-prune, where data is at risk
                    wait_for_save(proc, run / "checkpoints", timeout=60.0)
                    time.sleep(rng.uniform(0, 1.0))
                else:
                    time.sleep(rng.uniform(0, window))
            finished = proc.poll() is not None
            if not finished:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
        # the restart resumed from the newest complete checkpoint found at the last kill
        if expected_resume is not None:
            got = [ln for ln in log.read_text(errors="replace").splitlines() if "resumed from" in ln]
            if (expected_resume == 0 and not got) or (got and got[0].endswith(f"at step {expected_resume}")):
                resumed_ok += 1
            else:
                failures.append(f"segment {segment}: expected resume at step {expected_resume}, log says "
                                f"{got}")
        if finished:
            # it finished (or failed) on its own before the kill: the final run below resumes from the newest
            # complete checkpoint (the last step's, when it finished) and must not change anything
            expected_resume = max((s for s, c in step_folders(run / "checkpoints") if c), default=0)
            break
        kills += 1
        root = run / "checkpoints"
        steps = step_folders(root)
        leftovers = hidden(root)
        rows, cut = records(run / "metrics.jsonl")
        if any(x.endswith(".tmp") for x in leftovers):
            landed["mid-save (.tmp)"] += 1
        elif any(".old-" in x for x in leftovers):
            landed["mid-replace (.old-)"] += 1
        elif any(".del-" in x for x in leftovers):
            landed["mid-prune (.del-)"] += 1
        elif cut:
            landed["metrics line cut"] += 1
        else:
            landed["between saves"] += 1
        prev_leftovers = leftovers
        if any(not c for _, c in steps):
            failures.append(f"kill {kills}: incomplete step folder {[s for s, c in steps if not c]}")
        if len(steps) > 3:  # keep_last 2, plus one written and not yet pruned
            failures.append(f"kill {kills}: {len(steps)} step folders (keep_last 2)")
        best_present = (root / "best").is_dir() or any(x.startswith(".best.old-") for x in leftovers)
        if best_seen and not best_present:
            failures.append(f"kill {kills}: best/ lost")
        best_seen = best_seen or best_present
        logged = [r["step"] for r in rows]
        if logged != sorted(logged):
            failures.append(f"kill {kills}: metrics.jsonl steps out of order")
        expected_resume = max((s for s, c in steps if c), default=0)
        # after the restart, hidden leftovers must be gone and best/ must load: checked at the next segment
    # let the last segment finish, then compare with the uninterrupted reference
    final = subprocess.run(train_args(run, a.quick, max_steps), env=env(), capture_output=True, text=True)
    if final.returncode != 0:
        failures.append(f"final run failed: {final.stderr[-1500:]}")
    else:
        got = [ln for ln in final.stderr.splitlines() if "resumed from" in ln]
        if expected_resume and not (got and got[0].endswith(f"at step {expected_resume}")):
            failures.append(f"final run: expected resume at step {expected_resume}, log says {got}")
        elif expected_resume is not None:
            resumed_ok += 1
    root = run / "checkpoints"
    if hidden(root):
        failures.append(f"leftovers after the final run: {hidden(root)}")
    names = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    want_names = sorted(p.name for p in (ref / "checkpoints").iterdir())
    if names != want_names:
        failures.append(f"final checkpoints {names} != uninterrupted run's {want_names}")

    def strip(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]

    rows, _ = records(run / "metrics.jsonl")
    ref_rows, _ = records(ref / "metrics.jsonl")
    exact_metrics = strip(rows) == strip(ref_rows)
    if not exact_metrics:
        failures.append("metrics.jsonl differs from the uninterrupted run")
    last = f"step_{max_steps:08d}"
    got_w, want_w = root / last / "model.safetensors", ref / "checkpoints" / last / "model.safetensors"
    exact_weights = got_w.is_file() and got_w.read_bytes() == want_w.read_bytes()
    if not exact_weights:
        failures.append("final weights differ from the uninterrupted run")
    best_ok = False
    try:
        sys.path.insert(0, str(HERE.parent / "src"))
        import qkv

        qkv.from_pretrained(root / "best")
        best_eval = json.loads((root / "best" / "eval.json").read_text())
        ref_best = json.loads((ref / "checkpoints" / "best" / "eval.json").read_text())
        best_ok = True
        if best_eval != ref_best:
            failures.append(f"best/ is from step {best_eval.get('step')}, the uninterrupted run's from "
                            f"{ref_best.get('step')}")
    except Exception as e:  # noqa: BLE001
        failures.append(f"best/ does not load: {e}")

    result = {
        "kills": kills, "segments": segment, "max_steps": max_steps, "window_s": window, "seed": a.seed,
        "quick": a.quick, "targeted": not a.untargeted, "checkpoint_mb": round(ckpt_bytes / 2**20, 1),
        "landed": landed, "resumes_from_newest": resumed_ok, "resumes_checked": kills if kills else 0,
        "exact_metrics": exact_metrics, "exact_weights": exact_weights, "best_loads": best_ok,
        "failures": failures, "reference_s": round(t_ref, 1),
        "total_s": round(time.perf_counter() - t_all, 1),
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "robustness.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# kill -9 robustness ({kills} kills, {'quick' if a.quick else 'full'})", "",
          f"checkpoints ~{result['checkpoint_mb']} MB each (weights + AdamW state), saved every 2 steps, "
          f"keep_last 2, best/ every 5 steps; {max_steps} steps; kill delay uniform in [0, {window}] s after "
          "training starts"
          + ("" if a.untargeted else ", every second kill within 1 s after a save began"), "",
          "| check | result |", "|---|---|",
          f"| restarts that resumed from the newest complete checkpoint | {resumed_ok} / {kills} |",
          f"| final losses + evaluations == uninterrupted run | {exact_metrics} |",
          f"| final weights == uninterrupted run (bytes) | {exact_weights} |",
          f"| best/ loads at the end | {best_ok} |",
          f"| failures | {len(failures)} |", "", "| where the kill landed | kills |", "|---|---|"]
    md += [f"| {k} | {v} |" for k, v in landed.items()]
    md += ["", f"total {result['total_s']} s (reference run {result['reference_s']} s)"]
    md += [f"- {f}" for f in failures]
    (out / "robustness.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
